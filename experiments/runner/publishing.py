"""What a task publishes to the docs: tables of its committed records and figures drawn from them,
declared in ``experiments/<task>/published.py`` and written by ``python -m experiments.results``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pandas as pd

from analysis.curves import training_curves
from analysis.plots import paired_runs
from experiments.records import RunFolder
from experiments.runner.task import Task

#: draws a figure of ``results`` (the runs of ``folder``) to ``path``; returns the files written
Draw = Callable[[Task, pd.DataFrame, RunFolder, Path], list[Path]]
#: named tables of ``results`` drawn from the runs' saved files in ``folder`` besides their records
Tables = Callable[[pd.DataFrame, RunFolder], dict[str, pd.DataFrame]]


@dataclass(frozen=True)
class Table:
    """``<out>/<file>``: the task's table ``name`` of the runs in ``results/<source>``, with only
    ``columns`` (all of them if None). ``tables``: where the table comes from when the records
    alone do not give it (the runs' ``*.npz`` files); by default the task's tables."""

    file: str
    source: str
    name: str
    columns: Optional[tuple[str, ...]] = None
    tables: Optional[Tables] = None


@dataclass(frozen=True)
class Figure:
    """``<out>/<file>`` (or one file per panel, named from it): drawn by ``draw`` from the runs in
    ``results/<source>``."""

    file: str
    source: str
    draw: Draw


def paired_figure(task: Task, results: pd.DataFrame, folder: RunFolder, path: Path) -> list[Path]:
    """Every seed's first metric per variant, joined by seed (the runner's ``paired.png``)."""
    metrics = {p: task.metrics_of(p)[0] for p in results[task.panel].unique() if task.metrics_of(p)}
    return [paired_runs(results, task.panel, metrics, path)]


def curves_figure(task: Task, results: pd.DataFrame, folder: RunFolder, path: Path) -> list[Path]:
    """The validation curves of every run, a dot at its kept epoch (``python -m experiments.curves``)."""
    return [training_curves([r for r in folder.records() if r.get("training")], path)]
