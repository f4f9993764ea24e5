"""The uncertainty-under-shift tables of the VQA runs (:mod:`experiments.runner.shift_tables`, from
the runs' ``shift.npz`` of :mod:`experiments.vqa.ood`): the noisy image features' evaluation sets.

Detection tells each test question with noisy image features from its clean copy, one noise
variance at a time (columns ``var=<v>``); the noisy questions keep their answers, so each noisy
set is scored for accuracy, calibration and selective prediction of its own, and each gets its
risk-coverage curves and reliability diagram (``<stem>_noise<v>_<panel>.png``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import pandas as pd

from experiments.records import RunFolder
from experiments.runner.publishing import Draw
from experiments.runner.shift_tables import ID, EvaluationSet, ShiftStudy
from experiments.runner.task import Task
from experiments.vqa.ood import noise_levels, noise_set


def noise_settings(runs: pd.DataFrame) -> tuple[float, str]:
    """The runs' ``noise_variance`` and ``noise_sweep`` (one experiment's runs share them)."""
    return float(runs["noise_variance"].iloc[0]), str(runs["noise_sweep"].iloc[0])


def evaluation_sets(runs: pd.DataFrame) -> tuple[EvaluationSet, ...]:
    """``id``, then the noisy sets, ascending in variance."""
    return (ID, *(EvaluationSet(noise_set(v), f"var={v:g}") for v in noise_levels(*noise_settings(runs))))


#: its own figures show the runs' noisy data (``noise_variance``); the published ones, every level (:func:`at_every_level`)
STUDY = ShiftStudy(
    panel="dataset", sets=evaluation_sets, shown=lambda runs: noise_set(noise_settings(runs)[0]),
    risk_coverage_title=lambda dataset, shown: f"{dataset}: test questions, image noise {shown.label}",
    reliability_title=lambda dataset, shown: f"{dataset}: test questions, image noise {shown.label}",
)
shift_tables = STUDY.tables


def at_every_level(figures: Callable[[ShiftStudy, Task, pd.DataFrame, RunFolder, Path], list[Path]]) -> Draw:
    """A :class:`ShiftStudy` figure method drawn once per noisy set, ``<stem>_noise<v>`` (then ``_<panel>``)."""
    def draw(task: Task, results: pd.DataFrame, folder: RunFolder, path: Path) -> list[Path]:
        written = []
        for v in noise_levels(*noise_settings(results)):
            study = dataclasses.replace(STUDY, shown=lambda runs, v=v: noise_set(v))
            written += figures(study, task, results, folder, path.with_name(f"{path.stem}_{noise_set(v)}{path.suffix}"))
        return written
    return draw


risk_coverage_figures = at_every_level(ShiftStudy.risk_coverage_figures)
reliability_figures = at_every_level(ShiftStudy.reliability_figures)
