"""What the GLUE task publishes to the docs: dev-set scores of soft and BAM-WC finetuning, paired
by seed, one table per folder of runs that share their settings (``python -m experiments.results glue``):
the tasks on their full training sets (``glue``), SST-2 on the fixed 2,000-example subset.

:data:`SHIFT` holds the uncertainty-under-shift tables and figures of :mod:`experiments.glue.shift_tables`
(SST-2's dev sentences against other corpora), drawn from ``results/glue-sst2-shift`` and published
with the rest."""

from experiments.glue.shift_tables import reliability_figures, risk_coverage_figures, shift_tables
from experiments.runner.publishing import Figure, Table, paired_figure
from experiments.runner.shift_tables import TABLES as SHIFT_TABLES

SHIFT = (
    *(Table(f"glue_sst2_shift_{name}.md", "glue-sst2-shift", name, tables=shift_tables) for name in SHIFT_TABLES),
    Figure("glue_sst2_shift_risk_coverage.png", "glue-sst2-shift", risk_coverage_figures),
    Figure("glue_sst2_shift_reliability.png", "glue-sst2-shift", reliability_figures),
)

PUBLISHED = (
    Table("glue_dev.md", "glue", "glue"),
    Table("glue_sst2.md", "glue-sst2", "glue"),
    Figure("glue_dev_paired.png", "glue", paired_figure),
    Figure("glue_sst2_paired.png", "glue-sst2", paired_figure),
    *SHIFT,
)
