"""Posterior draws of finished GLUE SST-2 runs on SST-2's dev sentences and on sentences of other
corpora (:mod:`experiments.glue.shift`), saved for the uncertainty-under-shift tables
(:mod:`experiments.glue.shift_tables`).

    python -m experiments.glue.ood runs/glue-sst2/runs/* --data-root DATA

Each finished run folder gets ``shift.npz`` (:mod:`experiments.runner.shift_draws` says what it
holds), with ``--draws`` draws per sampling mode and set: ``mc_dropout`` for soft runs (the
network's own dropout on at test time), ``attention`` and ``attention_dropout`` for BAM runs. The
sets: ``id`` (SST-2 dev, with its labels) and the unlabelled ``multi30k``, ``rte`` and ``cola``,
each capped at ``--max-ood`` sentences (default 500, a random subset fixed for every run). A soft
run's ``val`` arrays are its logits and labels on the 1,000 SST-2 training examples it did not
train on, for temperature scaling. Every array is in its set's order (the sentences' file order),
not the length order the batches run in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from experiments.glue.data import Encoded, encode, evaluation_order
from experiments.glue.shift import ID_TASK, MAX_OOD, ood_frames, temperature_examples
from experiments.glue.task import TASK, GlueSettings, posterior_probs, predict
from experiments.runner import load_trained
from experiments.runner.shift_draws import sampling_modes, shift_parser, summarize_draws, write_shift_files

DRAWS = 10


def in_data_order(data: Encoded, values: np.ndarray, axis: int = 0) -> np.ndarray:
    """``values`` gathered batch by batch (in :func:`~experiments.glue.data.evaluation_order`), put
    back in the order of ``data``."""
    return np.take(values, np.argsort(evaluation_order(data), kind="stable"), axis=axis)


def check_run(run_dir: Path, settings: GlueSettings) -> None:
    """A run of SST-2 scored on its dev set, the in-distribution set of the shift study."""
    if settings.task != ID_TASK:
        raise ValueError(f"{run_dir}: a run of GLUE {settings.task}; the text shift sets are against {ID_TASK}")
    if settings.holdout is not None:
        raise ValueError(f"{run_dir}: scored on {settings.holdout} held-out training examples, not the {ID_TASK} dev set")


def shift_arrays(run_dir: Path, data_root: Optional[str], draws: int = DRAWS,
                 ood: Optional[dict[str, pd.DataFrame]] = None) -> dict[str, np.ndarray]:
    """What ``shift.npz`` holds for the finished SST-2 run in ``run_dir`` (module doc); ``ood``:
    the out-of-distribution sentences (:func:`~experiments.glue.shift.ood_frames`, read if None)."""
    settings, data, model = load_trained(TASK, run_dir, data_root)
    check_run(run_dir, settings)
    tokenizer, size = data.collator.tokenizer, settings.batch_size
    ood = ood_frames(data_root) if ood is None else ood
    sets = {"id": data.scored, **{name: encode(frame, tokenizer, settings.max_length) for name, frame in ood.items()}}
    modes = sampling_modes(model)
    deterministic = modes == ["mc_dropout"]
    arrays = {}
    if deterministic:
        held = encode(temperature_examples(settings.task, settings.max_train, data_root), tokenizer, settings.max_length)
        logits, labels = (in_data_order(held, v) for v in predict(model.network, held, size, data.collator))
        arrays["val.logits"], arrays["val.labels"] = logits.astype(np.float16), labels.astype(np.int8)
    for name, encoded in sets.items():
        if name == "id":
            arrays["id.labels"] = encoded.labels.numpy().astype(np.int8)
        if deterministic:
            arrays[f"{name}.logits"] = in_data_order(encoded, predict(model.network, encoded, size, data.collator)[0]).astype(np.float16)
        for mode in modes:
            probs, _ = posterior_probs(model, encoded, size, data.collator, draws, seed=settings.seed, dropout="dropout" in mode)
            arrays[f"{name}.{mode}.probs"], arrays[f"{name}.{mode}.mutual_info"] = summarize_draws(in_data_order(encoded, probs, axis=1))
    return arrays


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    parser = shift_parser("python -m experiments.glue.ood", __doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=DRAWS, help=f"posterior draws per mode and set (default {DRAWS})")
    parser.add_argument("--max-ood", type=int, default=MAX_OOD,
                        help=f"sentences kept of each out-of-distribution set, a fixed random subset (default {MAX_OOD})")
    args = parser.parse_args(argv)
    if args.draws < 2:
        parser.error(f"--draws must be at least 2 (the mutual information needs two), got {args.draws}")
    try:  # read once for every run, before any model is loaded
        ood = ood_frames(args.data_root, args.max_ood)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return write_shift_files(parser, args, lambda run_dir: shift_arrays(run_dir, args.data_root, args.draws, ood))


if __name__ == "__main__":
    main()
