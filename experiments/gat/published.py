"""What the GAT task publishes to the docs: the accuracy and uncertainty tables, the paired runs,
the training curves and the reliability diagrams (``python -m experiments.results gat``), and the
uncertainty-under-shift tables and figures of :mod:`experiments.gat.shift_tables` (word flips:
``results/graph-shift``; left-out classes: ``results/graph-left-out``), and the accuracy of training
on neighbour-sampled mini-batches (``results/gat-minibatch``, on the scaling page)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.plots import reliability_diagram
from experiments.gat.shift_tables import reliability_figures as shift_reliability_figures
from experiments.gat.shift_tables import risk_coverage_figures, shift_tables
from experiments.gat.uncertainty import long_format, reliability_curves
from experiments.records import RunFolder
from experiments.runner import Task
from experiments.runner.publishing import Figure, Table, curves_figure, paired_figure
from experiments.runner.shift_tables import TABLES as SHIFT_TABLES


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
    Table("gat_minibatch.md", "gat-minibatch", "accuracy"),  # Cora on neighbour-sampled mini-batches
    Table("gat_uncertainty.md", "graph", "uncertainty",
          ("dataset", "variant", "mode", "seeds", "test_acc", "sample_acc", "nll", "ece", "pavpu@0.05")),
    Figure("gat_paired.png", "gat", paired_figure),
    Figure("gat_curves.png", "gat", curves_figure),
    Figure("gat_reliability.png", "graph", reliability_figures),
    *(Table(f"gat_shift_{name}.md", "graph-shift", name, tables=shift_tables) for name in SHIFT_TABLES),
    Figure("gat_shift_risk_coverage.png", "graph-shift", risk_coverage_figures),
    Figure("gat_shift_reliability.png", "graph-shift", shift_reliability_figures),
    # the left-out classes' nodes have no labels the network knows: no reliability diagram of them
    *(Table(f"gat_left_out_{name}.md", "graph-left-out", name, tables=shift_tables) for name in SHIFT_TABLES),
    Figure("gat_left_out_risk_coverage.png", "graph-left-out", risk_coverage_figures),
)
