"""BAM-WC GAT trained in neighbour-sampled mini-batches against full-batch: peak memory and step time.

    python -m experiments.bench gat-minibatch                                      Cora
    python -m experiments.bench gat-minibatch --nodes 200000 --edges 2000000       a random graph of that size

The graph is ``bench gat``'s (Cora, or a random graph with dense features, a tenth of the nodes
labelled). Each mode runs in a fresh process that builds the data and the model, takes one step
(lazy initialization), then measures: ``*_peak_mb`` is the peak memory of the measured steps above
the memory before them (the kernel's resident high-water mark on the CPU, returning freed blocks to
the OS; the allocator's peak on a GPU), i.e. what training needs on top of the graph and the
parameters; ``*_ms`` the median step time. A full-batch step is one pass over the graph; a
mini-batch step samples one batch of seeds (the sampling counted in its time and memory) and
trains on its subgraph with the unbiased ELBO of :mod:`bam_pyro.pyg.minibatch`.

Memory measurements run in a fresh process on the CPU and in the benchmark's own process on a GPU
(:func:`~experiments.runner.benchmarking.memory_measurement`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Optional

from experiments.runner.benchmarking import add_device_option, memory_measurement, step_peak_mb, synchronized
from experiments.runner import whole_number

MODES = ("full", "minibatch")


def training_step(mode: str, nodes: Optional[int], edges: Optional[int], features: int, data_root: Optional[str],
                  batch_size: int, fanout: list[int], device: str) -> tuple[Callable[[], Any], str]:
    """One BAM-WC SVI step of ``mode`` on the benchmark graph (on ``device``), and the graph's name."""
    import torch
    from torch_geometric.data import Data

    from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
    from bam_pyro.pyg import FullGraph, NeighborBatches, SubgraphNodeClassifier
    from bam_pyro.training import SVITrainer
    from experiments.gat.benchmark import graph
    from models.gat import build_node_classifier

    x, edge_index, y, train, num_classes, name = graph(nodes, edges, features, data_root)
    x, edge_index, y, train = (t.to(device) for t in (x, edge_index, y, train))
    torch.manual_seed(0)
    config = BamConfig("wc", k=1.0, beta=1e-10, d_mid=1)
    model = build_node_classifier(x.size(1), num_classes, config, ObjectiveConfig(anneal_rate=0.1))
    if mode == "minibatch":
        labelled = torch.zeros(x.size(0), dtype=torch.bool, device=device)
        labelled[train] = True
        model = SubgraphNodeClassifier(model.network, model.objective, FullGraph.of(edge_index, x.size(0), train, labelled))
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
    trainer = SVITrainer(model, AttentionGuide(model.model), optimizer)
    if mode == "full":
        return (lambda: trainer.step(x, edge_index, y=y, nodes=train)), name
    loader = NeighborBatches(Data(x=x, y=y, edge_index=edge_index), fanout, batch_size, input_nodes=train)
    batches = iter(())

    def step() -> float:
        nonlocal batches
        batch = next(batches, None)
        if batch is None:  # a new epoch
            batches = iter(loader)
            batch = next(batches)
        return trainer.step(batch.x, batch.edge_index, y=batch.y, num_seeds=batch.batch_size)

    return step, name


def measure(mode: str, size: tuple, batch_size: int, fanout: list[int], device: str, steps: int, threads: int) -> dict:
    """Peak memory (MB) of ``steps`` steps above the memory before them, and their median time (ms)."""
    import torch

    torch.set_num_threads(threads)
    step, name = training_step(mode, *size, batch_size, fanout, device)
    step = synchronized(device, step)
    step()  # lazy initialization
    times: list[float] = []

    def timed_steps() -> None:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - start))

    peak = step_peak_mb(timed_steps, device)
    return {"graph": name, "peak_mb": peak, "ms": statistics.median(times)}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.bench gat-minibatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole_number(1), default=None)
    p.add_argument("--edges", type=whole_number(1), default=None)
    p.add_argument("--features", type=whole_number(1), default=128, help="feature width of a random graph")
    p.add_argument("--batch-size", type=whole_number(1), default=512, help="seed nodes per mini-batch")
    p.add_argument("--num-neighbors", type=int, nargs="+", default=[10, 10], help="incoming edges sampled per node and layer")
    p.add_argument("--steps", type=whole_number(1), default=None, help="measured steps (default 20 on Cora, 2 on a given size)")
    p.add_argument("--threads", type=whole_number(1), default=1)
    p.add_argument("--data-root", default=None)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    add_device_option(p)
    args = p.parse_args(argv)
    if (args.nodes is None) != (args.edges is None):
        p.error("--nodes and --edges go together")
    steps = args.steps or (20 if args.nodes is None else 2)
    size = (args.nodes, args.edges, args.features, args.data_root)
    result: dict[str, Any] = {"batch_size": args.batch_size, "num_neighbors": args.num_neighbors, "steps": steps,
                              "threads": args.threads, "device": args.device}
    for mode in args.modes:
        figures = memory_measurement(measure, (mode, size, args.batch_size, args.num_neighbors, args.device, steps, args.threads),
                                     args.device)
        result["graph"] = figures["graph"]
        result[f"{mode}_peak_mb"] = round(figures["peak_mb"], 1)
        result[f"{mode}_ms"] = round(figures["ms"], 1)
    if len(args.modes) == 2:
        result["mem_ratio"] = round(result["minibatch_peak_mb"] / max(result["full_peak_mb"], 1e-9), 4)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
