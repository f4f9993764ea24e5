"""Training-step time and peak memory: PyG's GATConv GAT vs this project's soft GAT vs BAM-WC.

    python -m experiments.bench gat                              Cora (real data when present)
    python -m experiments.bench gat --nodes 200000 --edges 2000000   a random graph of that size

Times come from one subprocess that builds all models and takes their steps in turn (round-robin),
so that every model sees the same machine conditions; each time is the median over its timed steps.
CPU torch keeps no allocator statistics, so memory is read from the kernel in one subprocess per
model, where glibc hands every block of 64 KiB or more straight back to the OS
(``MALLOC_MMAP_THRESHOLD_``), making resident memory follow live tensors: ``*_peak_mb`` is the
peak resident memory during the training steps (the kernel's high-water mark, reset just before
them) minus the resident memory before them, i.e. what a step needs on top of data and parameters. GATConv and soft are plain
cross-entropy/ELBO steps; BAM-WC is the full SVI step (``TraceMeanField_ELBO``, KL and all).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GATConv

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.training import SVITrainer
from experiments.gat import TRAINING
from experiments.runs import whole_number
from guides import AttentionGuide
from models.gat import build_node_classifier

MODELS = ("gatconv", "soft", "wc")


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
    """Cora when no size is given (real data if found, else a random graph of Cora's size)."""
    if nodes is None:
        try:
            from experiments.planetoid import load_planetoid

            data, num_features, num_classes = load_planetoid("cora", data_root)
            return data.x, data.edge_index, data.y, data.train_mask.nonzero().flatten(), num_classes, "cora"
        except FileNotFoundError:
            nodes, edges, features = 2708, 10556, 1433
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


def resident_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: now, VmHWM: high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args: argparse.Namespace) -> dict:
    """Memory: the step of model ``args.worker`` alone. Time: all of ``args.models``, in turn."""
    torch.set_num_threads(args.threads)
    x, edge_index, y, train, num_classes, description = graph(args.nodes, args.edges, args.features, args.data_root)
    names = [args.worker] if args.measure == "memory" else args.models
    steps = {name: step_function(name, x, edge_index, y, train, num_classes, args.dropout_per_head) for name in names}
    for step in steps.values():
        step()  # first step: lazy initialization
    gc.collect()
    if args.measure == "memory":
        before = resident_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
        steps[args.worker]()
        return {"peak_mb": max(resident_kib("VmHWM") - before, 0) / 1024, "graph": description}
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {"ms": {name: 1000 * statistics.median(t) for name, t in times.items()}, "graph": description}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.bench gat", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole_number(1), default=None)
    p.add_argument("--edges", type=whole_number(1), default=None)
    p.add_argument("--features", type=whole_number(1), default=128, help="feature width of a random graph")
    p.add_argument("--steps", type=whole_number(1), default=None, help="timed steps (default 100 on Cora, 5 on a given size)")
    p.add_argument("--threads", type=whole_number(1), default=2)
    p.add_argument("--data-root", default=None)
    p.add_argument("--dropout-per-head", action=argparse.BooleanOptionalAction, default=TRAINING["cora"]["dropout_per_head"],
                   help="this project's GATs drop inputs with a mask per head (the Cora preset's setting)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--worker", choices=(*MODELS, "all"), help=argparse.SUPPRESS)
    p.add_argument("--measure", choices=("time", "memory"), default="time", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if (args.nodes is None) != (args.edges is None):
        p.error("--nodes and --edges go together")
    if args.steps is None:
        args.steps = 100 if args.nodes is None else 5
    if args.worker:
        print(json.dumps(worker(args)))
        return
    passthrough = list(argv if argv is not None else sys.argv[2:])

    def run_worker(name: str, measure: str) -> dict:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536") if measure == "memory" else None
        out = subprocess.run(
            [sys.executable, "-m", "experiments.benchmarks.gat", *passthrough, "--worker", name, "--measure", measure],
            capture_output=True, text=True, env=env,
        )
        if out.returncode != 0:
            raise RuntimeError(f"the {measure} measurement of {name} failed:\n{out.stderr.strip()}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    timed = run_worker("all", "time")
    figures = {name: {"ms": timed["ms"][name], "graph": timed["graph"], **run_worker(name, "memory")} for name in args.models}
    result = {"graph": next(iter(figures.values()))["graph"], "threads": args.threads, "steps": args.steps,
              "dropout_per_head": args.dropout_per_head}
    key = {"gatconv": "gatconv", "soft": "soft", "wc": "bam"}
    for name, fig in figures.items():
        result[f"{key[name]}_ms"] = round(fig["ms"], 2)
        result[f"{key[name]}_peak_mb"] = round(fig["peak_mb"], 1)
    if "gatconv" in figures and "wc" in figures:
        result["time_ratio"] = round(figures["wc"]["ms"] / figures["gatconv"]["ms"], 3)
        result["mem_ratio"] = round(figures["wc"]["peak_mb"] / max(figures["gatconv"]["peak_mb"], 1e-9), 3)
    if "gatconv" in figures and "soft" in figures:
        result["soft_time_ratio"] = round(figures["soft"]["ms"] / figures["gatconv"]["ms"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
