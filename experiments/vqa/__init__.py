"""Visual question answering on easy-VQA with MCAN, and its uncertainty: ``python -m experiments.vqa``."""

from experiments.catalog import Benchmark, CheckRun, TaskFolder

FOLDER = TaskFolder(
    name="vqa",
    benchmarks=(Benchmark("vqa", "benchmark", "easy-VQA MCAN training step: soft vs BAM-WC",
                          ("--steps", "5", "--warmup", "1", "--train-images", "500"), 25, ("easy_vqa",)),),
    check_runs=(CheckRun("vqa", ("--max-epochs", "1", "--train-images", "1000", "--test-images", "200", "--samples", "0"), 30,
                         ("easy_vqa",)),),
    publishes=True,
)
