"""Posterior draws of finished GAT runs on in-distribution, out-of-distribution and shifted test
nodes, saved for the uncertainty-under-shift tables (:mod:`experiments.gat.shift_tables`).

    python -m experiments.gat.ood runs/graph-shift/runs/* runs/graph-left-out/runs/* --data-root DATA

Each finished run folder gets ``shift.npz`` (written atomically), holding per evaluation set:
the labels, soft runs' deterministic logits and, per sampling mode
of :mod:`experiments.gat.uncertainty` (``mc_dropout`` for soft runs, ``attention`` and
``attention_dropout`` for BAM runs), the mean of ``--samples`` draws of the class probabilities and
their mutual information with the draw (computed in float64 from the draws). Soft runs also save
the validation nodes' logits and labels, for temperature scaling. The sets: ``id``, the test nodes
(of the kept classes); with ``--left-out``, ``ood``, the left-out classes' test nodes; without,
``flip<p>``, the test nodes with their words flipped at each strength of
:data:`~experiments.gat.shift.FLIP_STRENGTHS`. The draws themselves are not kept, and
probabilities and logits are float16 (readers renormalize; the mutual information is float32), so
that the committed files stay small.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from bam_pyro.metrics import mutual_information
from bam_pyro.predictive import predictive_draws
from bam_pyro.training import seed_everything
from experiments.gat.shift import FLIP_STRENGTHS, flip_features
from experiments.gat.task import TASK
from experiments.gat.uncertainty import modes_for
from experiments.records import write_atomically
from experiments.runner import load_trained

SHIFT_FILE = "shift.npz"
SAMPLES = 50


def flip_set(p: float) -> str:
    """The name of the evaluation set flipped at strength ``p``: ``flip0.01``."""
    return f"flip{p:g}"


def evaluation_set_names(left_out: int) -> list[str]:
    """The evaluation sets of a run trained with ``left_out`` classes hidden (module doc)."""
    return ["id", "ood"] if left_out else ["id", *map(flip_set, FLIP_STRENGTHS)]


def evaluation_sets(data, left_out: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per set name (:func:`evaluation_set_names`), the node features to run on and the nodes to score."""
    test = data.test_mask.nonzero().flatten()
    sets = {"id": (data.x, test)}
    if left_out:
        sets["ood"] = (data.x, data.ood_mask.nonzero().flatten())
    else:
        sets.update({flip_set(p): (flip_features(data.x, test, p), test) for p in FLIP_STRENGTHS})
    return sets


def shift_arrays(run_dir: Path, data_root: Optional[str], samples: int = SAMPLES) -> dict[str, np.ndarray]:
    """What ``shift.npz`` holds for the finished run in ``run_dir`` (module doc)."""
    settings, (data, _, _), model = load_trained(TASK, run_dir, data_root)
    modes = modes_for(model)
    deterministic = modes == ["mc_dropout"]
    arrays = {}
    with torch.no_grad():
        if deterministic:
            val = data.val_mask.nonzero().flatten()
            arrays["val.logits"] = model.network(data.x, data.edge_index)[val].half().numpy()
            arrays["val.labels"] = data.y[val].numpy().astype(np.int8)
        for name, (x, nodes) in evaluation_sets(data, settings.left_out).items():
            arrays[f"{name}.labels"] = data.y[nodes].numpy().astype(np.int8)
            if deterministic:
                arrays[f"{name}.logits"] = model.network(x, data.edge_index)[nodes].half().numpy()
            for mode in modes:
                dropout = "dropout" in mode
                seed_everything(settings.seed)
                draws = predictive_draws(model, (x, data.edge_index), samples, dropout=dropout,
                                         chunk_size=settings.dropout_chunk if dropout else settings.chunk)
                probs = draws.probs[:, nodes].double()
                probs = (probs / probs.sum(-1, keepdim=True)).numpy()
                arrays[f"{name}.{mode}.probs"] = probs.mean(0).astype(np.float16)
                arrays[f"{name}.{mode}.mutual_info"] = mutual_information(probs).astype(np.float32)
    return arrays


def write_shift_draws(run_dir: Path, data_root: Optional[str], samples: int = SAMPLES) -> Path:
    """``shift.npz`` of the run in ``run_dir``, written atomically."""
    arrays = shift_arrays(run_dir, data_root, samples)
    path = run_dir / SHIFT_FILE
    write_atomically(path, lambda partial: np.savez_compressed(partial, **arrays))
    return path


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m experiments.gat.ood", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders, <out>/runs/<run>")
    parser.add_argument("--data-root", help="the data root the runs were trained from")
    parser.add_argument("--samples", type=int, default=SAMPLES, help=f"posterior draws per mode and set (default {SAMPLES})")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--redo", action="store_true", help="draw again for runs that have a shift.npz")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    written = []
    for run_dir in args.runs:
        if (run_dir / SHIFT_FILE).is_file() and not args.redo:
            continue
        try:
            written.append(write_shift_draws(run_dir, args.data_root, args.samples))
        except (ValueError, OSError) as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        print(written[-1], flush=True)
    return written


if __name__ == "__main__":
    main()
