"""What the VQA task publishes to the docs: the paper's Tables 2 and 7 layouts, the paired
differences to soft, the uncertainty of posterior draws and the noise sweep
(``python -m experiments.results vqa``).

:data:`SHIFT` holds the uncertainty-under-shift tables and figures of :mod:`experiments.vqa.shift_tables`
(clean against noisy image features), drawn from ``results/vqa-shift`` and published with the rest."""

from experiments.runner.publishing import Figure, Table, paired_figure
from experiments.runner.shift_tables import TABLES as SHIFT_TABLES
from experiments.vqa.shift_tables import reliability_figures, risk_coverage_figures, shift_tables

SHIFT = (
    *(Table(f"vqa_shift_{name}.md", "vqa-shift", name, tables=shift_tables) for name in SHIFT_TABLES),
    Figure("vqa_shift_risk_coverage.png", "vqa-shift", risk_coverage_figures),
    Figure("vqa_shift_reliability.png", "vqa-shift", reliability_figures),
)

PUBLISHED = (
    Table("vqa_table2.md", "vqa", "table2"),
    Table("vqa_table2_paired.md", "vqa", "table2-paired"),
    Table("vqa_table7.md", "vqa", "table7"),
    Table("vqa_uncertainty.md", "vqa", "uncertainty"),
    Table("vqa_noise_sweep.md", "vqa", "noise-sweep"),
    Figure("vqa_paired.png", "vqa", paired_figure),
    *SHIFT,
)
