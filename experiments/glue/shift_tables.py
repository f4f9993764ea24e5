"""The uncertainty-under-shift tables of the GLUE SST-2 runs (:mod:`experiments.runner.shift_tables`,
from the runs' ``shift.npz`` of :mod:`experiments.glue.ood`): the text study's evaluation sets.

Detection tells the sentences of each other corpus (``multi30k``, ``rte``, ``cola``: novel inputs,
unlabelled) from SST-2's dev sentences, as Hendrycks et al. (2020) do; accuracy, calibration and
selective prediction are those of the dev set, the one set with SST-2 labels, and so are the
figures.
"""

from __future__ import annotations

from experiments.glue.shift import OOD_SETS
from experiments.runner.shift_tables import ID, EvaluationSet, ShiftStudy

#: SST-2 dev, then the other corpora
SETS = (ID, *(EvaluationSet(name, name, labelled=False) for name in OOD_SETS))

STUDY = ShiftStudy(
    panel="task", sets=lambda runs: SETS, shown=lambda runs: ID.name,
    risk_coverage_title=lambda task, shown: f"{task}: dev sentences",
    reliability_title=lambda task, shown: f"{task}: dev sentences",
)
shift_tables = STUDY.tables
predictions = STUDY.predictions
risk_coverage_figures = STUDY.risk_coverage_figures
reliability_figures = STUDY.reliability_figures
