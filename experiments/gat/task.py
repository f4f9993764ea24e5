"""Bayesian GAT on Planetoid graphs (paper, Section 4.1 and appendix B.1), one SVI run per
(data set, variant, seed).

    python -m experiments.gat --dataset cora citeseer --variant soft wc --seeds 0 1 2
    python -m experiments.gat --dataset cora --variant soft wc --seeds 0 1 --samples 100 --chains 2 --out runs/graph

Presets hold the paper's hyperparameters; every one can be overridden. Test accuracy is the
posterior-mean prediction of the epoch early stopping kept. With ``--samples M`` each run also
scores M posterior draws of the test nodes' class probabilities (the uncertainty table: NLL, ECE,
PAvPU, ...), from MC dropout for soft attention and from attention noise, with and without dropout,
for BAM; with ``--chains C`` BAM runs also write ArviZ diagnostics of the attention into a few test
nodes (``python -m analysis.report OUT`` gathers them into a report).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pandas as pd
import torch
import torch.nn.functional as F

from bam_pyro import AttentionGuide
from bam_pyro.training import EarlyStopping, seed_everything
from experiments.gat.uncertainty import attention_diagnostics, draw_figures, score_modes, uncertainty_table
from experiments.gat.planetoid import NAMES, load_planetoid
from experiments.gat.shift import leave_out_classes
from experiments.runner import RunContext, RunSettings, Task, paired_table, positive, require, run_cli
from bam_pyro.pyg import FullGraph, NeighborBatches, NodeClassifier, SubgraphNodeClassifier, validate_graph
from models.gat import build_node_classifier

#: Test accuracy of the paper's Table 1 (mean of 5 runs).
PAPER_ACCURACY = {
    "cora": {"soft": 83.00, "nokl": 83.39, "lf": 83.24, "lc": 83.34, "wf": 83.48, "wc": 83.81},
    "citeseer": {"soft": 72.50, "nokl": 72.91, "lf": 72.86, "lc": 73.04, "wf": 73.18, "wc": 73.52},
    "pubmed": {"soft": 77.26, "nokl": 78.50, "lf": 78.30, "lc": 78.76, "wf": 78.50, "wc": 78.82},
}

#: optimizer and output heads per data set (GAT; appendix B.1.2)
TRAINING = {
    "cora": dict(lr=0.005, weight_decay=5e-4, out_heads=1),
    "citeseer": dict(lr=0.005, weight_decay=5e-4, out_heads=1),
    "pubmed": dict(lr=0.01, weight_decay=1e-3, out_heads=8),
}

#: BAM per data set and variant (appendix B.1.2); sigma_p / sigma_q are the paper's sigma_1 /
#: sigma_2, anneal_rate its rho. The paper does not give the KL weight.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "cora": {
        "nokl": dict(k=1.0),
        "lf": dict(sigma_p=1e15, sigma_q=1e-6, anneal_rate=0.2),
        "lc": dict(sigma_p=1e15, sigma_q=1e-15, anneal_rate=0.1, d_mid=1),
        "wf": dict(k=1.0, beta=1e-10, alpha=1e-15, anneal_rate=0.2),
        "wc": dict(k=1.0, beta=1e-10, anneal_rate=0.1, d_mid=1),
    },
    "citeseer": {
        "nokl": dict(k=100.0),
        "lf": dict(sigma_p=1e15, sigma_q=1e-6, anneal_rate=0.1),
        "lc": dict(sigma_p=1e15, sigma_q=1e-5, anneal_rate=0.1, d_mid=1),
        "wf": dict(k=100.0, beta=1e-15, alpha=1e-7, anneal_rate=0.1),
        "wc": dict(k=100.0, beta=1e-15, anneal_rate=0.1, d_mid=1),
    },
    "pubmed": {
        "nokl": dict(k=10.0),
        "lf": dict(sigma_p=1e6, sigma_q=1e-2, anneal_rate=0.2),
        "lc": dict(sigma_p=1e5, sigma_q=1e-2, anneal_rate=0.2, d_mid=5),
        "wf": dict(k=10.0, beta=1e-8, alpha=1e-4, anneal_rate=0.2),
        "wc": dict(k=10.0, beta=1e-4, anneal_rate=0.2, d_mid=5),
    },
}


@dataclass(frozen=True)
class GatSettings(RunSettings):
    dataset: str = "cora"
    lr: float = 0.005
    weight_decay: float = 5e-4
    out_heads: int = 1
    dropout_per_head: bool = field(default=True, metadata={
        "help": "an input dropout mask per head and dropout of the messages (original GAT code)"})
    max_epochs: int = 1000
    patience: int = 100
    samples: int = field(default=0, metadata={"help": "posterior draws M for the uncertainty metrics (0: none)"})
    chunk: int = field(default=100, metadata={"help": "draws per vectorized pass (attention noise)"})
    dropout_chunk: int = field(default=10, metadata={"help": "draws per pass with MC dropout (inputs copied per draw)"})
    chains: int = field(default=0, metadata={"help": "chains of the ArviZ diagnostics of BAM's attention (0: none)"})
    diag_nodes: int = field(default=3, metadata={"help": "test nodes whose attention is diagnosed"})
    batch_size: Optional[int] = field(default=None, metadata={
        "help": "seed nodes per mini-batch, with neighbour sampling (default: full-batch training)"})
    num_neighbors: str = field(default="10,10", metadata={
        "help": "mini-batches: incoming edges sampled per node, one count per layer ('10,10'; -1: all)"})
    seed_nodes: Literal["train", "all"] = field(default="train", metadata={
        "help": "mini-batches: seeds from the training nodes (KL of their rows) or all nodes (the full-graph ELBO)"})
    left_out: int = field(default=0, metadata={
        "help": "hide the last N classes' labels; their test nodes are the OOD set (0: none; GPN: cora 3, citeseer 2)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.dataset in NAMES, "dataset", self.dataset, f"one of {sorted(NAMES)}")
        positive("lr", self.lr)
        positive("weight_decay", self.weight_decay, strict=False)
        for name in ("out_heads", "max_epochs", "patience", "chunk", "dropout_chunk", "diag_nodes"):
            positive(name, getattr(self, name), minimum=1, strict=False)
        positive("chains", self.chains, strict=False)
        positive("left_out", self.left_out, strict=False)
        require(self.samples == 0 or self.samples >= 2, "samples", self.samples, "0 or at least 2 (PAvPU's t-test)")
        positive("batch_size", self.batch_size, minimum=1, strict=False)
        fanout = self.num_neighbors.replace(",", " ").split()
        require(len(fanout) == 2 and all(n.lstrip("-").isdigit() and (int(n) > 0 or n == "-1") for n in fanout),
                "num_neighbors", self.num_neighbors, "two counts, one per GAT layer, each positive or -1 (e.g. '10,10')")

    @property
    def fanout(self) -> list[int]:
        return [int(n) for n in self.num_neighbors.replace(",", " ").split()]


def presets(dataset: str, variant: str) -> dict[str, Any]:
    return {**TRAINING[dataset], **PRESETS[dataset].get(variant, {})}


def build_model(settings: GatSettings, num_features: int, num_classes: int) -> NodeClassifier:
    """The untrained GAT these settings describe."""
    return build_node_classifier(num_features, num_classes, settings.attention, settings.objective,
                                 out_heads=settings.out_heads, dropout_per_head=settings.dropout_per_head)


def node_metrics(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(cross-entropy, accuracy) of posterior-mean logits on the masked nodes."""
    loss = F.cross_entropy(logits[mask], y[mask]).item()
    acc = (logits[mask].argmax(-1) == y[mask]).float().mean().item()
    return loss, acc


def train_classifier(settings: GatSettings, graph, run: RunContext) -> NodeClassifier:
    """Train with early stopping on validation loss and accuracy; the model of the kept epoch."""
    data, num_features, num_classes = graph
    validate_graph(data.x, data.edge_index)
    seed_everything(settings.seed)
    model = build_model(settings, num_features, num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    if settings.batch_size is None:
        batch = ((data.x, data.edge_index), dict(y=data.y, nodes=data.train_mask.nonzero().flatten()))
        batches = lambda: [batch]  # noqa: E731  (the whole graph, every epoch)
    else:
        model, batches = minibatch_training(model, data, settings)
    trainer = run.trainer(model, AttentionGuide(model.model), optimizer)

    def evaluate() -> dict[str, float]:
        val_loss, val_acc = node_metrics(model.network(data.x, data.edge_index), data.y, data.val_mask)
        return {"val_loss": val_loss, "val_acc": val_acc}

    stopping = EarlyStopping({"val_loss": "min", "val_acc": "max"}, patience=settings.patience)
    trainer.fit(batches, evaluate, settings.max_epochs, stopping, run.progress, run.description)
    return model


def minibatch_training(model: NodeClassifier, data, settings: GatSettings):
    """The model and the epoch's batches of neighbour-sampled mini-batch training: seeds from the
    training nodes (or all nodes), the ELBO scaled to be unbiased (``bam_pyro.pyg.minibatch``)."""
    seeds = data.train_mask.nonzero().flatten() if settings.seed_nodes == "train" else torch.arange(data.num_nodes)
    full = FullGraph.of(data.edge_index, data.num_nodes, seeds, data.train_mask)
    model = SubgraphNodeClassifier(model.network, settings.objective, full)
    loader = NeighborBatches(data, settings.fanout, settings.batch_size, input_nodes=seeds)

    def batches():
        for batch in loader:
            labelled = batch.train_mask[:batch.batch_size].nonzero().flatten()
            yield (batch.x, batch.edge_index), dict(y=batch.y, nodes=labelled, num_seeds=batch.batch_size)

    return model, batches


def train(settings: GatSettings, graph, run: RunContext) -> dict[str, float]:
    graph = (graph[0].to(run.device), *graph[1:])  # trained and scored where the model is
    model = train_classifier(settings, graph, run)
    data = graph[0]
    model.eval()
    with torch.no_grad():
        logits = model.network(data.x, data.edge_index)
    metrics = {"val_acc": 100 * node_metrics(logits, data.y, data.val_mask)[1],
               "test_acc": 100 * node_metrics(logits, data.y, data.test_mask)[1]}
    if settings.samples:
        metrics.update(score_modes(model, data, settings, run.folder, run.engine))
    if settings.chains and settings.attention.prior is not None:
        attention_diagnostics(model, data, settings, run.folder, run.engine)
    return metrics


def tables(results: pd.DataFrame) -> dict[str, pd.DataFrame]:
    found = {"accuracy": paired_table(TASK, results)}
    if any("." in column for column in results):
        found["uncertainty"] = uncertainty_table(results, PAPER_ACCURACY)
    return found


def load(settings: GatSettings, data_root: Optional[str]):
    graph = load_planetoid(settings.dataset, data_root)
    return leave_out_classes(*graph, settings.left_out) if settings.left_out else graph


TASK = Task(
    name="gat", settings=GatSettings, panel="dataset", panels=tuple(NAMES), load=load, train=train,
    metrics=("test_acc", "val_acc"), presets=presets, tables=tables,
    paper={dataset: {variant: {"test_acc": f"{acc:.2f}"} for variant, acc in accs.items()} for dataset, accs in PAPER_ACCURACY.items()},
    after_sweep=draw_figures, build=lambda settings, graph: build_model(settings, *graph[1:]),
    description=__doc__.split("\n\n")[0],
)


def main(argv: Optional[list[str]] = None) -> dict[str, pd.DataFrame]:
    return run_cli(TASK, argv)

