"""Image captioning with Att2in on Flickr8k or a Karpathy split, its scores and attention: ``python -m experiments.captioning``."""

from experiments.catalog import ALL_CORES, DATA_ROOT, Benchmark, CheckRun, CheckStep, TaskFolder

FOLDER = TaskFolder(
    name="captioning",
    benchmarks=(Benchmark("captioning", "benchmark", "Att2in captioning training step: soft vs BAM-WC",
                          ("--steps", "5", "--warmup", "1", "--memory-repeats", "1"), 20, ("efficientnet_lite_pytorch",)),),
    # the image grids, computed once on all CPU cores before the benchmark and the training run read
    # them (skipped with them where there is no GPU: minutes of a small CPU)
    check_steps=(CheckStep("caption-features", "features", ("--threads", ALL_CORES), 25, ("efficientnet_lite_pytorch",)),),
    check_runs=(CheckRun("captioning", ("--max-epochs", "1", "--train-images", "200", "--val-images", "25", "--test-images", "25",
                                        DATA_ROOT), 25, ("efficientnet_lite_pytorch", "pycocoevalcap")),),
    publishes=True,
)
