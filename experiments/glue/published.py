"""What the GLUE task publishes to the docs: dev-set scores of soft and BAM-WC finetuning, paired
by seed, one table per folder of runs that share their settings (``python -m experiments.results glue``):
RTE on its full training set, SST-2 on the fixed 2,000-example subset."""

from experiments.runner.publishing import Figure, Table, paired_figure

PUBLISHED = (
    Table("glue_rte.md", "glue", "glue"),
    Table("glue_sst2.md", "glue-sst2", "glue"),
    Figure("glue_rte_paired.png", "glue", paired_figure),
    Figure("glue_sst2_paired.png", "glue-sst2", paired_figure),
)
