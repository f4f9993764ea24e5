"""The text shift of the uncertainty-under-shift tables, after Hendrycks et al. (2020): a model
finetuned on SST-2 (movie-review sentences) meets sentences of other corpora, out of distribution.

The sets, all read from the data root (nothing is downloaded):

- ``id``: the SST-2 dev set (872 labelled sentences; SST-2's test set has no labels), the run's
  own scored split;
- ``multi30k``: the English side of Multi30k's 2016 Flickr test set (image captions,
  ``multi30k/test_2016_flickr.en.gz``);
- ``rte``: the RTE dev set's second sentences (``sentence2``, the hypothesis: one short sentence
  about news or Wikipedia text), one sentence per input as the model was trained on; the premises
  are often passages of several sentences, up to ``max_length`` tokens and about ten times the cost;
- ``cola``: the CoLA dev set's sentences (linguistics textbook examples, grammatical or not).

Each out-of-distribution set is capped at ``max_ood`` sentences, a random subset fixed by
:data:`OOD_SEED` (the same sentences for every run, so that runs pool and pair item by item), kept
in file order. They carry no SST-2 labels.

Temperature scaling is fitted on :data:`TEMPERATURE_EXAMPLES` SST-2 training examples the run
never trained on: the rows that follow its ``max_train`` subset in the subset's fixed permutation
(:func:`~experiments.glue.data.beyond_subset`). Disjoint by row, not by text: SST-2's training rows
are phrases of parsed sentences, so a held-out phrase may be part of a trained one.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import pandas as pd

from experiments.data_root import gzip_lines, require_files, resolve_data_root
from experiments.glue.data import beyond_subset, read_split

#: the in-distribution task and the out-of-distribution sets, in the tables' order
ID_TASK = "sst2"
OOD_SETS = ("multi30k", "rte", "cola")
MULTI30K_FILE = "test_2016_flickr.en.gz"
#: the column of a GLUE dev set read as out-of-distribution sentences (RTE: the hypotheses)
OOD_COLUMNS = {"rte": "text_b", "cola": "text_a"}
#: the default cap on each out-of-distribution set, and the seed of the sentences it keeps
MAX_OOD = 500
OOD_SEED = 43
#: held-out training examples the temperature is fitted on
TEMPERATURE_EXAMPLES = 1000


def multi30k_sentences(data_root: Optional[os.PathLike] = None) -> list[str]:
    """The English sentences of Multi30k's 2016 Flickr test set; errors name the file (and line)."""
    folder = resolve_data_root(data_root)[0] / "multi30k"
    require_files(folder, [MULTI30K_FILE], "Multi30k's English test sentences")
    lines = gzip_lines(folder / MULTI30K_FILE)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"{folder / MULTI30K_FILE}, line {number}: empty sentence")
    return lines


def ood_sentences(name: str, data_root: Optional[os.PathLike] = None) -> list[str]:
    """Every sentence of out-of-distribution set ``name`` (module doc), in file order."""
    if name == "multi30k":
        return multi30k_sentences(data_root)
    if name in OOD_COLUMNS:
        return read_split(name, "dev", data_root)[OOD_COLUMNS[name]].tolist()
    raise ValueError(f"unknown out-of-distribution set {name!r}; expected one of {list(OOD_SETS)}")


def capped(sentences: list[str], max_ood: int) -> list[str]:
    """At most ``max_ood`` of ``sentences``: a random subset fixed by :data:`OOD_SEED`, in their order."""
    if max_ood < 1:
        raise ValueError(f"max_ood must be at least 1, got {max_ood}")
    if len(sentences) <= max_ood:
        return list(sentences)
    kept = np.sort(np.random.default_rng(OOD_SEED).permutation(len(sentences))[:max_ood])
    return [sentences[i] for i in kept]


def ood_frames(data_root: Optional[os.PathLike], max_ood: int = MAX_OOD) -> dict[str, pd.DataFrame]:
    """Per out-of-distribution set, its capped sentences as ``text_a`` with a placeholder label -1."""
    return {name: pd.DataFrame({"text_a": capped(ood_sentences(name, data_root), max_ood), "label": -1})
            for name in OOD_SETS}


def temperature_examples(task: str, max_train: Optional[int], data_root: Optional[os.PathLike] = None,
                         size: int = TEMPERATURE_EXAMPLES) -> pd.DataFrame:
    """``size`` labelled training examples of ``task`` outside a run's ``max_train`` subset (module doc)."""
    if max_train is None:
        raise ValueError(f"the run trained on the whole {task} training set: no labelled example is left "
                         "to fit the temperature on (train with --max-train)")
    return beyond_subset(read_split(task, "train", data_root), max_train, size)
