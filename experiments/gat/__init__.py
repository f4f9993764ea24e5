"""Node classification with graph attention on Planetoid (Cora, Citeseer, Pubmed), and its uncertainty: ``python -m experiments.gat``."""

from experiments.catalog import DATA_ROOT, Benchmark, CheckRun, TaskFolder

FOLDER = TaskFolder(
    name="gat",
    benchmarks=(
        Benchmark("gat", "benchmark", "training step: PyG GATConv vs soft vs BAM-WC [--nodes N --edges E]",
                  ("--steps", "10", DATA_ROOT), 25),
        Benchmark("gat-minibatch", "benchmark_minibatch",
                  "BAM-WC step: neighbour-sampled mini-batches vs full-batch [--nodes N --edges E]", ("--steps", "5", DATA_ROOT), 20),
        Benchmark("predictive", "benchmark_predictive", "posterior samples of a trained BAM-WC GAT",
                  ("--untrained", "--repeats", "2", DATA_ROOT), 20),
    ),
    check_runs=(
        CheckRun("gat", ("--dataset", "cora", "--max-epochs", "200", "--patience", "200", DATA_ROOT), 25),
        CheckRun("gat-minibatch", ("--dataset", "cora", "--batch-size", "35", "--max-epochs", "20", DATA_ROOT), 20),
    ),
    publishes=True,
)
