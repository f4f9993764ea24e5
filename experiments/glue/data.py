"""GLUE tasks from their original tsv files: reading, splits, the task's metrics, tokenized batches.

The tsv files live under ``<data root>/glue/<TASK>/{train,dev}.tsv`` (the data root comes from
``--data-root``, ``$BAM_DATA`` or :func:`experiments.data_root.resolve_data_root`); with no data root
anywhere, the ``datasets`` library fetches the hub's copy of GLUE into the user cache. Batches are padded
per batch and drawn from buckets of similar length, which makes CPU finetuning several times
faster than padding everything to a fixed length.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pandas as pd
import torch
from scipy import stats
from sklearn.metrics import f1_score, matthews_corrcoef
from transformers import AutoTokenizer, DataCollatorWithPadding

from experiments.data_root import require_files, resolve_data_root, utf8_lines


@dataclass(frozen=True)
class GlueTask:
    """Where a task's columns are and how it is scored.

    ``num_labels`` is 1 for regression (STS-B). ``labels`` maps the file's label text to class
    indices when the file stores names rather than numbers. The first metric is the one GLUE
    ranks by.
    """

    folder: str
    text_columns: tuple[str, ...]
    label_column: str
    num_labels: int
    metrics: tuple[str, ...]
    header: bool = True
    column_names: Optional[tuple[str, ...]] = None
    labels: Optional[dict[str, int]] = None

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1


TASKS: dict[str, GlueTask] = {
    "rte": GlueTask("RTE", ("sentence1", "sentence2"), "label", 2, ("accuracy",),
                    labels={"entailment": 0, "not_entailment": 1}),
    "mrpc": GlueTask("MRPC", ("#1 String", "#2 String"), "Quality", 2, ("f1", "accuracy")),
    "cola": GlueTask("CoLA", ("sentence",), "label", 2, ("matthews",), header=False,
                     column_names=("source", "label", "original_label", "sentence")),
    "stsb": GlueTask("STS-B", ("sentence1", "sentence2"), "score", 1, ("pearson", "spearman")),
    "sst2": GlueTask("SST-2", ("sentence",), "label", 2, ("accuracy",)),
}


def read_split(task: str, split: str, data_root: Optional[os.PathLike] = None) -> pd.DataFrame:
    """One split as a DataFrame with columns ``text_a`` (, ``text_b``) and ``label``."""
    if task not in TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; expected one of {sorted(TASKS)}")
    spec = TASKS[task]
    root, given = resolve_data_root(data_root)
    if not given:
        return hub_split(task, split, root)
    folder = root / "glue" / spec.folder
    require_files(folder, [f"{split}.tsv"], f"GLUE {task}")
    path = folder / f"{split}.tsv"
    try:
        frame = pd.read_csv(path, sep="\t", quoting=csv.QUOTE_NONE, encoding="utf-8-sig",
                            header=0 if spec.header else None, names=spec.column_names, keep_default_na=False, dtype=str)
    except pd.errors.ParserError as error:  # "Error tokenizing data. C error: Expected 4 fields in line 6, saw 5"
        raise ValueError(f"{path}: {str(error).strip().split('C error: ')[-1]}") from None
    except UnicodeDecodeError:
        with open(path, "rb") as handle:
            for _ in utf8_lines(path, handle):  # raises, naming the line
                pass
        raise
    missing = [c for c in (*spec.text_columns, spec.label_column) if c not in frame.columns]
    if missing:
        raise ValueError(f"{folder / f'{split}.tsv'} has no column(s) {missing}; found {list(frame.columns)}")
    out = pd.DataFrame({name: frame[col] for name, col in zip(("text_a", "text_b"), spec.text_columns)})
    raw = frame[spec.label_column]
    if spec.is_regression:
        out["label"] = raw.astype(np.float32)
    elif spec.labels is not None:
        unknown = sorted(set(raw) - set(spec.labels))
        if unknown:
            raise ValueError(f"{task} {split}: unknown labels {unknown[:5]}")
        out["label"] = raw.map(spec.labels).astype(np.int64)
    else:
        out["label"] = raw.astype(np.int64)
    return out


HUB_DATASET = "nyu-mll/glue"
HUB_SPLITS = {"train": "train", "dev": "validation"}


def hub_split(task: str, split: str, cache: Path) -> pd.DataFrame:
    """One split of the hub's GLUE, fetched by ``datasets`` into ``cache``, in :func:`read_split`'s
    columns. Its label codes are those of the tsv files (RTE: 0 = entailment)."""
    from datasets import load_dataset  # imported only where a download can happen

    spec = TASKS[task]
    frame = load_dataset(HUB_DATASET, task, split=HUB_SPLITS[split], cache_dir=str(cache / "datasets")).to_pandas()
    texts = ("sentence1", "sentence2") if len(spec.text_columns) == 2 else ("sentence",)
    out = pd.DataFrame({name: frame[col] for name, col in zip(("text_a", "text_b"), texts)})
    out["label"] = frame["label"].astype(np.float32 if spec.is_regression else np.int64)
    return out


# --- metrics -------------------------------------------------------------------------------


def accuracy(pred: np.ndarray, label: np.ndarray) -> float:
    return float(np.mean(pred == label))


def f1(pred: np.ndarray, label: np.ndarray) -> float:
    """F1 of the positive class (1), as GLUE scores MRPC."""
    return float(f1_score(label, pred, zero_division=0.0))


def matthews(pred: np.ndarray, label: np.ndarray) -> float:
    """Matthews correlation (0 for a constant predictor)."""
    return float(matthews_corrcoef(label, pred))


def pearson(pred: np.ndarray, label: np.ndarray) -> float:
    return float(stats.pearsonr(pred, label)[0])


def spearman(pred: np.ndarray, label: np.ndarray) -> float:
    return float(stats.spearmanr(pred, label)[0])


METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson, "spearman": spearman}


def task_metrics(task: str, pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    """The task's GLUE metrics in percent: ``pred`` are class indices, or scores for STS-B."""
    return {name: 100 * METRICS[name](np.asarray(pred), np.asarray(label)) for name in TASKS[task].metrics}


# --- tokenized, length-bucketed batches ----------------------------------------------------


@dataclass
class Encoded:
    """A tokenized split: one list of token ids (and segment ids) per example, and the labels."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)


def encode(frame: pd.DataFrame, tokenizer, max_length: int) -> Encoded:
    """Tokenize (pairs are truncated longest-first to ``max_length``), without padding."""
    pairs = frame["text_b"].tolist() if "text_b" in frame else None
    tokens = tokenizer(frame["text_a"].tolist(), pairs, truncation=True, max_length=max_length,
                       return_token_type_ids=True)
    return Encoded(tokens["input_ids"], tokens["token_type_ids"], torch.tensor(frame["label"].to_numpy()))


def collate(data: Encoded, index: np.ndarray, collator: DataCollatorWithPadding) -> tuple[tuple, dict]:
    """The examples ``index`` padded to their longest by transformers' collator:
    ``((input_ids, attention_mask, token_type_ids), {"labels"})``."""
    padded = collator([{"input_ids": data.input_ids[i], "token_type_ids": data.token_type_ids[i]} for i in index])
    return (padded["input_ids"], padded["attention_mask"], padded["token_type_ids"]), {"labels": data.labels[index]}


def evaluation_order(data: Encoded) -> np.ndarray:
    """The order unshuffled :func:`batches` take the examples in: by length, ties in data order.
    Outputs gathered batch by batch are in this order; ``outputs[argsort(order)]`` restores the data's."""
    return np.argsort([len(ids) for ids in data.input_ids], kind="stable")


def batches(
    data: Encoded, batch_size: int, collator: DataCollatorWithPadding, shuffle: bool,
    rng: Optional[np.random.Generator] = None, bucket: int = 50,
) -> Iterator[tuple[tuple, dict]]:
    """Batches of similar length. With ``shuffle``, examples are shuffled, sorted by length within
    chunks of ``bucket`` batches, and the batches are shuffled; without it, the whole split is
    sorted by length (evaluation: order does not matter, padding is minimal)."""
    lengths = np.array([len(ids) for ids in data.input_ids])
    if shuffle:
        rng = rng or np.random.default_rng()
        order = rng.permutation(len(data))
        chunks = [order[i:i + bucket * batch_size] for i in range(0, len(order), bucket * batch_size)]
        order = np.concatenate([c[np.argsort(lengths[c], kind="stable")] for c in chunks])
    else:
        order = evaluation_order(data)
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        groups = [groups[i] for i in rng.permutation(len(groups))]
    for group in groups:
        yield collate(data, group, collator)


# --- the data of one task's runs ------------------------------------------------------------


@dataclass
class GlueData:
    """What one task's runs train and are scored on (``scored``: the dev or held-out split)."""

    train: Encoded
    scored: Encoded
    collator: DataCollatorWithPadding


def subset_order(n: int) -> np.ndarray:
    """The fixed permutation of a training set of ``n`` examples whose first rows :func:`subset` keeps."""
    return np.random.default_rng(0).permutation(n)


def subset(frame: pd.DataFrame, size: Optional[int]) -> pd.DataFrame:
    """The first ``size`` rows of a fixed permutation (the same subset for every run)."""
    if size is None or size >= len(frame):
        return frame
    return frame.iloc[subset_order(len(frame))[:size]].reset_index(drop=True)


def beyond_subset(frame: pd.DataFrame, trained: int, size: int) -> pd.DataFrame:
    """``size`` training examples that a run on :func:`subset` ``(frame, trained)`` never saw: the
    next ``size`` rows of the same permutation (held-out labels for post-hoc calibration)."""
    if not 0 < size <= len(frame) - trained:
        raise ValueError(f"{size} examples beyond the first {trained} of a training set of {len(frame)}: "
                         f"at most {len(frame) - trained} are left")
    return frame.iloc[subset_order(len(frame))[trained:trained + size]].reset_index(drop=True)


def holdout_split(frame: pd.DataFrame, size: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rest, held out): ``size`` examples held out of a training set by a fixed permutation, the
    same for every run, so hyperparameters can be chosen without looking at the dev set."""
    if not 0 < size < len(frame):
        raise ValueError(f"holdout must be between 1 and {len(frame) - 1} "
                         f"(the training set has {len(frame)} examples), got {size}")
    order = np.random.default_rng(1).permutation(len(frame))
    return frame.iloc[order[size:]].reset_index(drop=True), frame.iloc[order[:size]].reset_index(drop=True)


def load_glue(task: str, tokenizer_path: str, max_length: int, max_train: Optional[int],
              holdout: Optional[int], data_root: Optional[os.PathLike] = None) -> GlueData:
    """Tokenized training split (a fixed subset of ``max_train``) and scored split (dev, or
    ``holdout`` examples held out of training)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    train = read_split(task, "train", data_root)
    train, scored = (train, read_split(task, "dev", data_root)) if holdout is None else holdout_split(train, holdout)
    return GlueData(encode(subset(train, max_train), tokenizer, max_length), encode(scored, tokenizer, max_length),
                    DataCollatorWithPadding(tokenizer, return_tensors="pt"))
