"""What the VQA task publishes to the docs: the paper's Tables 2 and 7 layouts, the paired
differences to soft, the uncertainty of posterior draws and the noise sweep
(``python -m experiments.results vqa``)."""

from experiments.runner.publishing import Figure, Table, paired_figure

PUBLISHED = (
    Table("vqa_table2.md", "vqa", "table2"),
    Table("vqa_table2_paired.md", "vqa", "table2-paired"),
    Table("vqa_table7.md", "vqa", "table7"),
    Table("vqa_uncertainty.md", "vqa", "uncertainty"),
    Table("vqa_noise_sweep.md", "vqa", "noise-sweep"),
    Figure("vqa_paired.png", "vqa", paired_figure),
)
