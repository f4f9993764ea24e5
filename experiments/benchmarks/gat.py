"""Training-step time and peak memory: PyG's GATConv GAT vs this project's soft GAT vs BAM-WC.

    python -m experiments.bench gat                              Cora
    python -m experiments.bench gat --nodes 200000 --edges 2000000   a random graph of that size

Times come from one fresh process that builds all models and takes their steps in turn
(round-robin), so that every model sees the same machine conditions; each time is the median over
its timed steps. Memory comes from one fresh process per model, returning freed blocks to the OS
(:mod:`experiments.benchmarks.process`): ``*_peak_mb`` is the peak resident memory during a
training step (the kernel's high-water mark, reset just before it) minus the resident memory before
it, i.e. what a step needs on top of data and parameters. GATConv and soft are plain
cross-entropy/ELBO steps; BAM-WC is the full SVI step (``TraceMeanField_ELBO``, KL and all).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GATConv

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.training import SVITrainer
from experiments.benchmarks.process import RETURN_FREED_BLOCKS, in_fresh_process, reset_peak, resident_mb
from experiments.gat import GatSettings
from experiments.planetoid import load_planetoid
from experiments.runner import whole_number
from bam_pyro import AttentionGuide
from models.gat import build_node_classifier

MODELS = ("gatconv", "soft", "wc")


class GraphSize(NamedTuple):
    """The graph to measure on: Cora when ``nodes`` is None, else a random graph of that size."""

    nodes: Optional[int]
    edges: Optional[int]
    features: int
    data_root: Optional[str]


class PygGAT(nn.Module):
    """The reference: two PyG GATConv layers, same architecture and dropout as models.gat.GAT."""

    def __init__(self, in_channels: int, num_classes: int, heads: int = 8, hidden: int = 8, dropout: float = 0.6) -> None:
        super().__init__()
        self.dropout = dropout
        self.conv1 = GATConv(in_channels, hidden, heads, dropout=dropout)
        self.conv2 = GATConv(hidden * heads, num_classes, 1, concat=False, dropout=dropout)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


def graph(nodes: Optional[int], edges: Optional[int], features: int, data_root: Optional[str]):
    """Cora (from the data root) when no size is given, else a random graph of that size."""
    if nodes is None:
        data, _, num_classes = load_planetoid("cora", data_root)
        return data.x, data.edge_index, data.y, data.train_mask.nonzero().flatten(), num_classes, "cora"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(nodes, features, generator=g)
    edge_index = torch.randint(0, nodes, (2, edges), generator=g)
    y = torch.randint(0, 7, (nodes,), generator=g)
    return x, edge_index, y, torch.arange(0, nodes, 10), 7, f"random({nodes} nodes, {edges} edges, {features} features)"


def step_function(name: str, x, edge_index, y, train, num_classes, dropout_per_head: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    if name == "gatconv":
        model = PygGAT(x.size(1), num_classes)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)

        def step() -> None:
            loss = F.cross_entropy(model(x, edge_index)[train], y[train])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        return step
    config = BamConfig(name, k=1.0, beta=1e-10, d_mid=1)
    model = build_node_classifier(
        x.size(1), num_classes, config, ObjectiveConfig(anneal_rate=0.1), dropout_per_head=dropout_per_head
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
    trainer = SVITrainer(model, AttentionGuide(model.model), optimizer)
    return lambda: trainer.step(x, edge_index, y=y, nodes=train)


def measure_time(models: list[str], size: GraphSize, steps: int, threads: int, dropout_per_head: bool) -> dict:
    """Median step time (ms) of each model, the models taking their steps in turn."""
    torch.set_num_threads(threads)
    data = graph(*size)
    step_of = {name: step_function(name, *data[:-1], dropout_per_head) for name in models}
    for step in step_of.values():
        step()  # first step: lazy initialization
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(steps):
        for name, step in step_of.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {"ms": {name: 1000 * statistics.median(t) for name, t in times.items()}, "graph": data[-1]}


def measure_memory(name: str, size: GraphSize, threads: int, dropout_per_head: bool) -> float:
    """Peak memory (MB) of one training step of ``name`` above the memory before it."""
    torch.set_num_threads(threads)
    step = step_function(name, *graph(*size)[:-1], dropout_per_head)
    step()  # first step: lazy initialization
    gc.collect()
    before = resident_mb()
    reset_peak()
    step()
    return max(resident_mb("VmHWM") - before, 0.0)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.bench gat", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole_number(1), default=None)
    p.add_argument("--edges", type=whole_number(1), default=None)
    p.add_argument("--features", type=whole_number(1), default=128, help="feature width of a random graph")
    p.add_argument("--steps", type=whole_number(1), default=None, help="timed steps (default 100 on Cora, 5 on a given size)")
    p.add_argument("--threads", type=whole_number(1), default=2)
    p.add_argument("--data-root", default=None)
    p.add_argument("--dropout-per-head", action=argparse.BooleanOptionalAction, default=GatSettings.dropout_per_head,
                   help="this project's GATs drop inputs with a mask per head (the Cora preset's setting)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = p.parse_args(argv)
    if (args.nodes is None) != (args.edges is None):
        p.error("--nodes and --edges go together")
    steps = args.steps or (100 if args.nodes is None else 5)
    size = GraphSize(args.nodes, args.edges, args.features, args.data_root)
    timed = in_fresh_process(measure_time, (args.models, size, steps, args.threads, args.dropout_per_head))
    result = {"graph": timed["graph"], "threads": args.threads, "steps": steps, "dropout_per_head": args.dropout_per_head}
    key = {"gatconv": "gatconv", "soft": "soft", "wc": "bam"}
    ms, peak_mb = timed["ms"], {}
    for name in args.models:
        peak_mb[name] = in_fresh_process(measure_memory, (name, size, args.threads, args.dropout_per_head), RETURN_FREED_BLOCKS)
        result[f"{key[name]}_ms"] = round(ms[name], 2)
        result[f"{key[name]}_peak_mb"] = round(peak_mb[name], 1)
    if "gatconv" in ms and "wc" in ms:
        result["time_ratio"] = round(ms["wc"] / ms["gatconv"], 3)
        result["mem_ratio"] = round(peak_mb["wc"] / max(peak_mb["gatconv"], 1e-9), 3)
    if "gatconv" in ms and "soft" in ms:
        result["soft_time_ratio"] = round(ms["soft"] / ms["gatconv"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
