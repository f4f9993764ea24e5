"""What the VQA task publishes to the docs: the paper's Tables 2 and 7 layouts, the paired
differences to soft, the uncertainty of posterior draws and the noise sweep
(``python -m experiments.results vqa``).

:data:`SHIFT` holds the uncertainty-under-shift tables and figures of :mod:`experiments.vqa.shift_tables`
(clean against noisy image features), drawn from ``results/vqa-shift``. They join :data:`PUBLISHED`
once that folder holds records: ``experiments.results`` reads every source a task publishes from,
and a source without runs is an error, not an empty table."""

from experiments.runner.publishing import Figure, Table, paired_figure
from experiments.runner.shift_tables import TABLES as SHIFT_TABLES
from experiments.vqa.shift_tables import reliability_figures, risk_coverage_figures, shift_tables

PUBLISHED = (
    Table("vqa_table2.md", "vqa", "table2"),
    Table("vqa_table2_paired.md", "vqa", "table2-paired"),
    Table("vqa_table7.md", "vqa", "table7"),
    Table("vqa_uncertainty.md", "vqa", "uncertainty"),
    Table("vqa_noise_sweep.md", "vqa", "noise-sweep"),
    Figure("vqa_paired.png", "vqa", paired_figure),
)

SHIFT = (
    *(Table(f"vqa_shift_{name}.md", "vqa-shift", name, tables=shift_tables) for name in SHIFT_TABLES),
    Figure("vqa_shift_risk_coverage.png", "vqa-shift", risk_coverage_figures),
    Figure("vqa_shift_reliability.png", "vqa-shift", reliability_figures),
)
