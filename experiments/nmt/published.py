"""What the translation task publishes to the docs: test and validation BLEU and perplexity of soft
and BAM-WC on Multi30k, paired by seed (``python -m experiments.results nmt``)."""

from experiments.runner.publishing import Figure, Table, paired_figure

PUBLISHED = (
    Table("nmt_multi30k.md", "nmt", "results"),
    Figure("nmt_paired.png", "nmt", paired_figure),
)
