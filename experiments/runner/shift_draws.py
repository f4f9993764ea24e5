"""Posterior draws of finished runs, saved for the uncertainty-under-shift tables: what the tasks'
``ood`` scripts share (:mod:`experiments.gat.ood`, :mod:`experiments.glue.ood`).

Each finished run folder gets ``shift.npz`` (written atomically), holding per evaluation set
``<set>``: ``<set>.labels`` (int8) where the set has labels; for soft runs, the deterministic
``<set>.logits`` and the held-out ``val.logits`` and ``val.labels`` that temperature scaling is
fitted on; and per sampling mode (:func:`sampling_modes`) ``<set>.<mode>.probs``, the mean of the
draws' class probabilities, and ``<set>.<mode>.mutual_info``, their mutual information with the
draw, computed in float64 from the draws (:func:`summarize_draws`). The draws themselves are not
kept, and probabilities and logits are float16 (readers renormalize; the mutual information is
float32), so that committed files stay small. :mod:`experiments.runner.shift_tables` reads them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Union

import numpy as np
import torch

from bam_pyro.metrics import mutual_information
from bam_pyro.predictive import has_stochastic_attention
from experiments.records import write_atomically

SHIFT_FILE = "shift.npz"


def sampling_modes(bam_model) -> list[str]:
    """The sampling modes of a model's draws: ``attention`` and ``attention_dropout`` (attention
    noise, without and with MC dropout) when its attention is stochastic, else ``mc_dropout``."""
    return ["attention", "attention_dropout"] if has_stochastic_attention(bam_model) else ["mc_dropout"]


def summarize_draws(probs: Union[torch.Tensor, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Draws ``[draws, items, classes]`` of class probabilities -> (their mean, float16; their mutual
    information with the draw, float32), both from the draws renormalized in float64."""
    probs = torch.as_tensor(probs).double()
    probs = (probs / probs.sum(-1, keepdim=True)).numpy()
    return probs.mean(0).astype(np.float16), mutual_information(probs).astype(np.float32)


def shift_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every ``ood`` script takes: the run folders, ``--data-root``, ``--threads`` and
    ``--redo``; a task adds its own (the number of draws) before parsing."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders, <out>/runs/<run>")
    parser.add_argument("--data-root", help="the data root the runs were trained from")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--redo", action="store_true", help=f"draw again for runs that have a {SHIFT_FILE}")
    return parser


def write_shift_files(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      arrays_of: Callable[[Path], dict[str, np.ndarray]]) -> list[Path]:
    """``shift.npz`` of every run in ``args.runs`` (skipping those that have one unless ``--redo``),
    from ``arrays_of(run_dir)``, written atomically; a path printed as each is written. A user error
    (a run that is not finished, a damaged or missing data file) ends the command with one line."""
    torch.set_num_threads(args.threads)
    written = []
    for run_dir in args.runs:
        path = run_dir / SHIFT_FILE
        if path.is_file() and not args.redo:
            continue
        try:
            arrays = arrays_of(run_dir)
            write_atomically(path, lambda partial: np.savez_compressed(partial, **arrays))
        except (ValueError, OSError) as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        written.append(path)
        print(path, flush=True)
    return written
