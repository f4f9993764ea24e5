"""GLUE finetuning of a pretrained BERT-style model with Bayesian attention: ``python -m experiments.glue``."""

from experiments.catalog import DATA_ROOT, PRETRAINED, Benchmark, CheckRun, TaskFolder

FOLDER = TaskFolder(
    name="glue",
    benchmarks=(Benchmark("bert", "benchmark", "finetuning step: soft vs BAM-WC MiniLM",
                          ("--steps", "5", "--warmup", "1", PRETRAINED), 25),),
    check_runs=(CheckRun("glue", ("--task", "rte", "--max-train", "1600", "--epochs", "1", "--draws", "0", PRETRAINED, DATA_ROOT),
                         35),),
    publishes=True,
)
