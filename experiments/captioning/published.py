"""What the captioning task publishes to the docs: the tables of :mod:`experiments.captioning.tables`
in Table 3's layout and the paired runs (``python -m experiments.results captioning``)."""

from experiments.runner.publishing import Figure, Table, paired_figure

PUBLISHED = (
    Table("captioning_table3.md", "captioning", "table3"),
    Table("captioning_paired.md", "captioning", "table3-paired"),
    Figure("captioning_paired.png", "captioning", paired_figure),
)
