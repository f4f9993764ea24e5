"""The uncertainty-under-shift tables of the GAT runs (:mod:`experiments.runner.shift_tables`, from
the runs' ``shift.npz`` of :mod:`experiments.gat.ood`): the graph's evaluation sets and figures.

On the word-flipped sets, detection tells each test node's flipped copy from its clean one, and
each flipped set is scored for accuracy, calibration and selective prediction of its own; on the
left-out sets, detection tells the left-out classes' test nodes from the kept ones', and selective
prediction on ``ID+OOD`` counts every left-out node as an error. The figures show the most flipped
words, or the kept and left-out nodes together.
"""

from __future__ import annotations

import pandas as pd

from experiments.gat.ood import evaluation_set_names
from experiments.runner.shift_tables import ID, EvaluationSet, ShiftStudy

#: the shifted set the figures show
FIGURE_FLIP = "flip0.05"
#: the left-out classes' test nodes: novel inputs, pooled with the kept ones for selective prediction
LEFT_OUT = EvaluationSet("ood", "OOD", labelled=False, suffix="", abstain_with_id=True)


def set_label(name: str) -> str:
    """``flip0.05`` -> ``p=0.05``; ``id`` -> ``ID``."""
    return {"id": "ID", "ood": "OOD"}.get(name, name.replace("flip", "p="))


def left_out(runs: pd.DataFrame) -> int:
    return int(runs["left_out"].iloc[0]) if "left_out" in runs else 0


def evaluation_sets(runs: pd.DataFrame) -> tuple[EvaluationSet, ...]:
    """The sets of one data set's runs: ``id`` and the left-out classes, or ``id`` and the flips."""
    names = evaluation_set_names(left_out(runs))
    return tuple(ID if n == "id" else LEFT_OUT if n == "ood" else EvaluationSet(n, set_label(n)) for n in names)


def risk_coverage_title(dataset: str, shown: EvaluationSet) -> str:
    if shown == LEFT_OUT:
        return f"{dataset}: kept and left-out classes' test nodes"
    return f"{dataset}: test nodes, words flipped at {shown.label}"


STUDY = ShiftStudy(
    panel="dataset", sets=evaluation_sets, shown=lambda runs: "ood" if left_out(runs) else FIGURE_FLIP,
    risk_coverage_title=risk_coverage_title,
    reliability_title=lambda dataset, shown: f"{dataset}: words flipped at {shown.label}",
)
shift_tables = STUDY.tables
predictions = STUDY.predictions
risk_coverage_figures = STUDY.risk_coverage_figures
reliability_figures = STUDY.reliability_figures
