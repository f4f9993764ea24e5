"""What the GAT task publishes to the docs: the accuracy and uncertainty tables, the paired runs,
the training curves and the reliability diagrams (``python -m experiments.results gat``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.plots import reliability_diagram
from experiments.gat.uncertainty import long_format, reliability_curves
from experiments.records import RunFolder
from experiments.runner import Task
from experiments.runner.publishing import Figure, Table, curves_figure, paired_figure


def reliability_figures(task: Task, results: pd.DataFrame, folder: RunFolder, path: Path) -> list[Path]:
    """A reliability diagram of the graph runs' test nodes per data set: ``<stem>_<dataset>.png``."""
    written = []
    for dataset, runs in long_format(results).groupby("dataset", sort=False):
        curves = reliability_curves(runs, folder)
        if curves:
            target = path.with_name(f"{path.stem}_{dataset}{path.suffix}")
            written.append(reliability_diagram(curves, target, title=f"{dataset} test nodes"))
    return written


PUBLISHED = (
    Table("gat_accuracy.md", "gat", "accuracy"),
    Table("gat_uncertainty.md", "graph", "uncertainty",
          ("dataset", "variant", "mode", "seeds", "test_acc", "sample_acc", "nll", "ece", "pavpu@0.05")),
    Figure("gat_paired.png", "gat", paired_figure),
    Figure("gat_curves.png", "gat", curves_figure),
    Figure("gat_reliability.png", "graph", reliability_figures),
)
