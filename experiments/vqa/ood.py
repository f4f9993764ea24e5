"""Posterior draws of finished VQA runs on the clean test questions and on the same questions with
noisy image features, saved for the uncertainty-under-shift tables (:mod:`experiments.vqa.shift_tables`).

    python -m experiments.vqa.ood runs/vqa-shift/runs/*

Each finished run folder gets ``shift.npz`` (:mod:`experiments.runner.shift_draws` says what it
holds), with ``--draws`` draws per sampling mode and set. The questions are the run's own fixed
uncertainty questions (``uncertainty_questions`` of the test set, those its PAvPU scored), and the
sets: ``id``, on clean grid features; ``noise<v>``, on the grid features with the task's feature
noise (:func:`~experiments.vqa.uncertainty.noisy`: the same seeded noise for every run, scaled) at
variance ``v``, for every variance the run scored besides 0 (its noisy data's and its noise
sweep's: 1, 2, 5 and 10 at the task's defaults). Noisy images keep their answers, so every set is
labelled. Each set's draws start from the run's seed: the same dropout masks on every set. A soft
run's ``val`` arrays are its logits and labels on :data:`VAL_QUESTIONS` validation questions (a
fixed random subset of the held-out training images'), for temperature scaling.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from experiments.runner import load_trained
from experiments.runner.shift_draws import sampling_modes, shift_parser, summarize_draws, write_shift_files
from experiments.vqa.task import TASK, sweep_variances
from experiments.vqa.uncertainty import (
    feature_noise, grid_features, noisy, posterior_mean_logits, posterior_probs, uncertainty_rows,
)

#: posterior draws per mode and set: the task's default ``samples``, BAM's and MC dropout's alike
DRAWS = 20
#: validation questions a soft run's temperature is fitted on
VAL_QUESTIONS = 2000
#: the task's sampling mode (:mod:`experiments.vqa.uncertainty`) that draws each mode of ``shift.npz``
TASK_MODES = {"mc_dropout": "full", "attention": "attention", "attention_dropout": "full"}


def noise_set(variance: float) -> str:
    """The name of the evaluation set noised at ``variance``: ``noise5``."""
    return f"noise{variance:g}"


def noise_levels(noise_variance: float, noise_sweep: str) -> list[float]:
    """The variances of a run's noisy sets, given its noise settings: every one it scored but 0, ascending."""
    return [v for v in sweep_variances(noise_variance, noise_sweep) if v > 0]


def shift_arrays(run_dir: Path, draws: int = DRAWS) -> dict[str, np.ndarray]:
    """What ``shift.npz`` holds for the finished VQA run in ``run_dir`` (module doc)."""
    settings, data, model = load_trained(TASK, run_dir)
    test, batch = data.test, settings.eval_batch
    rows = uncertainty_rows(test, settings.uncertainty_questions, settings.split_seed)
    clean = grid_features(model, test, batch)
    noise = feature_noise(clean.shape, settings.noise_seed)
    levels = noise_levels(settings.noise_variance, settings.noise_sweep)
    features = {"id": clean, **{noise_set(v): noisy(clean, noise, v) for v in levels}}
    modes = sampling_modes(model)
    deterministic = modes == ["mc_dropout"]
    drawing = dataclasses.replace(settings, samples=draws)
    arrays = {}
    if deterministic:
        held = uncertainty_rows(data.val, VAL_QUESTIONS, settings.split_seed)
        arrays["val.logits"] = posterior_mean_logits(model, data.val, batch, rows=held).half().numpy()
        arrays["val.labels"] = data.val.answers[held].numpy().astype(np.int8)
    for name, grid in features.items():
        arrays[f"{name}.labels"] = test.answers[rows].numpy().astype(np.int8)
        if deterministic:
            arrays[f"{name}.logits"] = posterior_mean_logits(model, test, batch, grid, rows).half().numpy()
        for mode in modes:
            probs = posterior_probs(model, test, grid, TASK_MODES[mode], rows, drawing)
            arrays[f"{name}.{mode}.probs"], arrays[f"{name}.{mode}.mutual_info"] = summarize_draws(probs)
    return arrays


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    parser = shift_parser("python -m experiments.vqa.ood", __doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=DRAWS, help=f"posterior draws per mode and set (default {DRAWS})")
    args = parser.parse_args(argv)
    if args.draws < 2:
        parser.error(f"--draws must be at least 2 (the mutual information needs two), got {args.draws}")
    if args.data_root is not None:
        parser.error(f"--data-root is not read: the data come from {TASK.data_source}")
    return write_shift_files(parser, args, lambda run_dir: shift_arrays(run_dir, args.draws))


if __name__ == "__main__":
    main()
