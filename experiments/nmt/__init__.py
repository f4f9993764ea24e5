"""Translation on Multi30k (de -> en), its decoding search and its attention's uncertainty: ``python -m experiments.nmt``."""

from experiments.catalog import DATA_ROOT, Benchmark, CheckRun, TaskFolder

FOLDER = TaskFolder(
    name="nmt",
    benchmarks=(Benchmark("nmt", "benchmark", "translation training step: soft vs BAM-WC LSTM", ("--steps", "3", "--warmup", "1"),
                          20),),
    check_runs=(CheckRun("nmt", ("--max-train", "6400", "--max-epochs", "1", "--beam-size", "1", "--uncertainty-draws", "0",
                                 DATA_ROOT), 35),),
    publishes=True,
)
