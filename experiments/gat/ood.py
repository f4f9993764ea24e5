"""Posterior draws of finished GAT runs on in-distribution, out-of-distribution and shifted test
nodes, saved for the uncertainty-under-shift tables (:mod:`experiments.gat.shift_tables`).

    python -m experiments.gat.ood runs/graph-shift/runs/* runs/graph-left-out/runs/* --data-root DATA

Each finished run folder gets ``shift.npz`` (:mod:`experiments.runner.shift_draws` says what it
holds), with ``--samples`` draws per sampling mode and set. The validation nodes are what soft
runs' temperature is fitted on. The sets: ``id``, the test nodes (of the kept classes); with
``--left-out``, ``ood``, the left-out classes' test nodes; without, ``flip<p>``, the test nodes
with their words flipped at each strength of :data:`~experiments.gat.shift.FLIP_STRENGTHS`. Every
set has labels (the left-out classes' own, outside the classifier's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from bam_pyro.predictive import predictive_draws
from bam_pyro.training import seed_everything
from experiments.gat.shift import FLIP_STRENGTHS, flip_features
from experiments.gat.task import TASK
from experiments.runner import load_trained
from experiments.runner.shift_draws import sampling_modes, shift_parser, summarize_draws, write_shift_files

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
    modes = sampling_modes(model)
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
                arrays[f"{name}.{mode}.probs"], arrays[f"{name}.{mode}.mutual_info"] = summarize_draws(draws.probs[:, nodes])
    return arrays


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    parser = shift_parser("python -m experiments.gat.ood", __doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=SAMPLES, help=f"posterior draws per mode and set (default {SAMPLES})")
    args = parser.parse_args(argv)
    return write_shift_files(parser, args, lambda run_dir: shift_arrays(run_dir, args.data_root, args.samples))


if __name__ == "__main__":
    main()
