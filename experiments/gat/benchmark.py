"""Training-step time and peak memory: PyG's GATConv GAT vs this project's soft GAT vs BAM-WC.

    python -m experiments.bench gat                              Cora
    python -m experiments.bench gat --nodes 200000 --edges 2000000   a random graph of that size
    python -m experiments.bench gat --compile --models soft wc      eager vs torch.compile'd networks
    python -m experiments.bench gat --compile step --models wc      ... and vs the whole SVI step compiled
    python -m experiments.bench gat --device cuda                   on a GPU

Times come from one fresh process that builds all models and takes their steps in turn
(round-robin), so that every model sees the same machine conditions; each time is the median over
its timed steps, and ``bam_over_soft_eager`` the median and interquartile range of BAM-WC's step
over soft's, step by step (the cost of Bayesian attention, with its spread). Memory comes from one fresh process per model, returning freed blocks to the OS
(:mod:`experiments.runner.benchmarking`): ``*_peak_mb`` is the peak resident memory during a
training step (the kernel's high-water mark, reset just before it) minus the resident memory before
it, i.e. what a step needs on top of data and parameters. GATConv and soft are plain
cross-entropy/ELBO steps; BAM-WC is the full SVI step (``TraceMeanField_ELBO``, KL and all).

``--compile`` adds each model with its network compiled (``torch.compile``, default mode, with
the Inductor options :data:`COMPILE_OPTIONS`, printed as ``compile_options``) to the round-robin
and reports, beside the medians, ratios of per-step times taken back to back (their median and
interquartile range): compiled BAM-WC over eager BAM-WC, and compiled BAM-WC over compiled soft.
Every model of such a run, eager or compiled, gets the graph with its self-loops replaced once
beforehand (:func:`models.gat.with_self_loops`) and layers that add none: the same edges, and no
per-call edge selection of data-dependent size, which would split the compiled graph.

What of the compiled network runs outside Inductor's generated code: Pyro's sample statements,
which split the graph at each attention site (see the Pyro integration page, "Devices and
precision"); the first layer's search for the nonzeros of the input features and the draw of the
per-head dropout masks there (eager by design: data, no gradient; :mod:`bam_pyro.pyg.gat_conv`);
the random draws (ATen's, with ``fallback_random``); and the matrix products, which Inductor hands
to ATen. The gathers and sums over the edges are Inductor's own loops. Memory is not measured with
``--compile``.

``--compile step`` adds a third form of each model: its whole step's loss compiled (for BAM-WC and
soft, ``torch.compile`` of the ELBO's ``differentiable_loss``: network, guide and loss; for GATConv,
of the network and the cross-entropy), with the ratios ``*_step_compiled_over_eager`` and
``*_step_over_network_compiled``. Pyro's bookkeeping in that step (param and sample statements,
the traces, the sum of the ELBO's terms) runs eagerly (:mod:`bam_pyro.elbo`, issue 44).

``--device cuda`` puts the graph and the models on a GPU: times wait for its kernels, memory is the
caching allocator's peak during a step.

Memory measurements run in a fresh process on the CPU and in the benchmark's own process on a GPU
(:func:`~experiments.runner.benchmarking.memory_measurement`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GATConv

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.elbo import AttentionMeanFieldELBO
from bam_pyro.training import SVITrainer
from experiments.runner.benchmarking import (
    add_device_option, add_profile_option, check_profile_option, in_fresh_process, memory_measurement, operator_profile,
    step_peak_mb, synchronized,
)
from experiments.gat.task import GatSettings
from experiments.gat.planetoid import load_planetoid
from experiments.runner import whole_number
from bam_pyro import AttentionGuide
from models.gat import build_node_classifier, with_self_loops

MODELS = ("gatconv", "soft", "wc")


class GraphSize(NamedTuple):
    """The graph to measure on: Cora when ``nodes`` is None, else a random graph of that size."""

    nodes: Optional[int]
    edges: Optional[int]
    features: int
    data_root: Optional[str]


class PygGAT(nn.Module):
    """The reference: two PyG GATConv layers, same architecture and dropout as models.gat.GAT."""

    def __init__(self, in_channels: int, num_classes: int, heads: int = 8, hidden: int = 8, dropout: float = 0.6,
                 add_self_loops: bool = True) -> None:
        super().__init__()
        self.dropout = dropout
        self.conv1 = GATConv(in_channels, hidden, heads, dropout=dropout, add_self_loops=add_self_loops)
        self.conv2 = GATConv(hidden * heads, num_classes, 1, concat=False, dropout=dropout, add_self_loops=add_self_loops)

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


#: suffix of a model's name in a ``--compile`` run: its network compiled
COMPILED = "+compile"
#: suffix of a model's name in a ``--compile step`` run: its whole step's loss compiled
COMPILED_STEP = "+step"

#: Inductor options of ``--compile`` (default mode otherwise): ATen's random draws (eager mode's
#: numbers; Inductor's own CPU draws, a Philox draw per element, ran slower) and 256-bit vectors
#: (8 lanes, one head's 8 channels: at AVX-512's 16 lanes Inductor vectorized the fused gathers
#: and scatters over the edges instead, element by element). Not ``cpp_wrapper``: its C++ wrapper
#: (torch 2.13) fails on the checkpointed per-head dropout of dense features (an AssertionError
#: on ``run_and_save_rng_state``). See the benchmarks page, "Compiled GAT".
COMPILE_OPTIONS = {"fallback_random": True, "cpp.simdlen": 256}


def step_function(name: str, x, edge_index, y, train, num_classes, dropout_per_head: bool,
                  loops_added: bool = False, device: str = "cpu") -> Callable[[], None]:
    """One training step of model ``name`` (``"wc+compile"``: its network compiled; ``"wc+step"``:
    the step's whole loss) on ``device`` (the graph is moved there). With ``loops_added`` the graph
    holds its self-loops already and the layers add none."""
    torch.manual_seed(0)
    whole_step = name.endswith(COMPILED_STEP)
    name, compiled = name.removesuffix(COMPILED).removesuffix(COMPILED_STEP), name.endswith(COMPILED)
    x, edge_index, y, train = (t.to(device) for t in (x, edge_index, y, train))
    if name == "gatconv":
        model = PygGAT(x.size(1), num_classes, add_self_loops=not loops_added).to(device)
        if compiled:
            model = torch.compile(model, options=COMPILE_OPTIONS)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)

        def loss_of(x, edge_index, y, train):
            return F.cross_entropy(model(x, edge_index)[train], y[train])

        if whole_step:
            loss_of = torch.compile(loss_of, options=COMPILE_OPTIONS)

        def step() -> None:
            loss = loss_of(x, edge_index, y, train)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        return synchronized(device, step)
    config = BamConfig(name, k=1.0, beta=1e-10, d_mid=1)
    model = build_node_classifier(
        x.size(1), num_classes, config, ObjectiveConfig(anneal_rate=0.1), dropout_per_head=dropout_per_head,
        add_self_loops=not loops_added,
    ).to(device)
    if compiled:
        model.network = torch.compile(model.network, options=COMPILE_OPTIONS)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
    elbo = AttentionMeanFieldELBO()
    if whole_step:  # SVITrainer takes any object with a differentiable_loss
        elbo = SimpleNamespace(differentiable_loss=torch.compile(elbo.differentiable_loss, options=COMPILE_OPTIONS))
    trainer = SVITrainer(model, AttentionGuide(model.model), optimizer, elbo=elbo)
    return synchronized(device, lambda: trainer.step(x, edge_index, y=y, nodes=train))


def measure_time(models: list[str], size: GraphSize, steps: int, threads: int, dropout_per_head: bool,
                 loops_added: bool = False, device: str = "cpu", profile: int = 0) -> dict:
    """Step times (s) of each model, the models taking their steps in turn: their medians (ms) and,
    per model, the list of times; with ``profile``, that many more steps of each profiled
    (:func:`operator_profile`: BAM-WC against soft, or against ``GATConv`` without soft)."""
    torch.set_num_threads(threads)
    x, edge_index, *rest, description = graph(*size)
    if loops_added:
        edge_index = with_self_loops(edge_index, x.size(0))
    step_of = {name: step_function(name, x, edge_index, *rest, dropout_per_head, loops_added, device) for name in models}
    for step in step_of.values():
        step()  # first steps: lazy initialization, compilation
        step()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(steps):
        for name, step in step_of.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    timing = {"ms": {name: 1000 * statistics.median(t) for name, t in times.items()}, "times": times, "graph": description}
    if profile:
        timing["profile"] = operator_profile(step_of, profile, ("soft" if "soft" in step_of else models[0], models[-1]))
    return timing


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict:
    """Median and interquartile range of the per-step ratios of two models' back-to-back steps."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {"median": round(statistics.median(ratios), 3), "iqr": [round(low, 3), round(high, 3)]}


def measure_memory(name: str, size: GraphSize, threads: int, dropout_per_head: bool, device: str = "cpu") -> float:
    """Peak memory (MB) of one training step of ``name`` above the memory before it."""
    torch.set_num_threads(threads)
    step = step_function(name, *graph(*size)[:-1], dropout_per_head, device=device)
    step()  # first step: lazy initialization
    return step_peak_mb(step, device)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
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
    p.add_argument("--compile", nargs="?", const="network", choices=("network", "step"), default=None,
                   help="also time each model with its network compiled (torch.compile); 'step': and with its "
                        "whole step's loss compiled too; no memory figures")
    add_device_option(p)
    add_profile_option(p)
    args = p.parse_args(argv)
    check_profile_option(p, args)
    if args.profile and args.compile:
        p.exit(2, f"{p.prog}: error: --profile profiles the eager steps; not with --compile\n")
    if (args.nodes is None) != (args.edges is None):
        p.error("--nodes and --edges go together")
    steps = args.steps or (100 if args.nodes is None else 5)
    size = GraphSize(args.nodes, args.edges, args.features, args.data_root)
    if args.compile:
        result = compiled_result(args.models, size, steps, args.threads, args.dropout_per_head, args.device,
                                 whole_step=args.compile == "step")
        print(json.dumps(result))
        return result
    timed = in_fresh_process(measure_time, (args.models, size, steps, args.threads, args.dropout_per_head, False, args.device,
                                            args.profile))
    result = {"graph": timed["graph"], "threads": args.threads, "steps": steps, "device": args.device,
              "dropout_per_head": args.dropout_per_head}
    key = {"gatconv": "gatconv", "soft": "soft", "wc": "bam"}
    ms, peak_mb = timed["ms"], {}
    for name in args.models:
        peak_mb[name] = memory_measurement(measure_memory, (name, size, args.threads, args.dropout_per_head, args.device),
                                           args.device)
        result[f"{key[name]}_ms"] = round(ms[name], 2)
        result[f"{key[name]}_peak_mb"] = round(peak_mb[name], 1)
    if "gatconv" in ms and "wc" in ms:
        result["time_ratio"] = round(ms["wc"] / ms["gatconv"], 3)
        result["mem_ratio"] = round(peak_mb["wc"] / max(peak_mb["gatconv"], 1e-9), 3)
    if "gatconv" in ms and "soft" in ms:
        result["soft_time_ratio"] = round(ms["soft"] / ms["gatconv"], 3)
    if "soft" in ms and "wc" in ms:
        result["bam_over_soft_eager"] = paired_ratio(timed["times"]["wc"], timed["times"]["soft"])
    if args.profile:
        result["profile"] = timed["profile"]
    print(json.dumps(result))
    return result


def compiled_result(models: list[str], size: GraphSize, steps: int, threads: int, dropout_per_head: bool,
                    device: str = "cpu", whole_step: bool = False) -> dict:
    """Eager and compiled step times of ``models`` in one round-robin, with the paired ratios; with
    ``whole_step`` also those of the whole step's loss compiled."""
    suffixes = ("", COMPILED, COMPILED_STEP) if whole_step else ("", COMPILED)
    names = [name + suffix for name in models for suffix in suffixes]
    timed = in_fresh_process(measure_time, (names, size, steps, threads, dropout_per_head, True, device))
    key = {"gatconv": "gatconv", "soft": "soft", "wc": "bam"}
    result = {"graph": timed["graph"], "threads": threads, "steps": steps, "device": device, "dropout_per_head": dropout_per_head,
              "self_loops": "added once beforehand", "compile_options": COMPILE_OPTIONS}
    for name in names:
        base = name.removesuffix(COMPILED).removesuffix(COMPILED_STEP)
        form = {COMPILED: "_compiled", COMPILED_STEP: "_step_compiled"}.get(name[len(base):], "")
        result[f"{key[base]}{form}_ms"] = round(timed["ms"][name], 2)
    times = timed["times"]
    for name in models:
        result[f"{key[name]}_compiled_over_eager"] = paired_ratio(times[name + COMPILED], times[name])
        if whole_step:
            result[f"{key[name]}_step_compiled_over_eager"] = paired_ratio(times[name + COMPILED_STEP], times[name])
            result[f"{key[name]}_step_over_network_compiled"] = paired_ratio(times[name + COMPILED_STEP], times[name + COMPILED])
    if "wc" in models and "soft" in models:
        result["bam_over_soft_compiled"] = paired_ratio(times["wc" + COMPILED], times["soft" + COMPILED])
        result["bam_over_soft_eager"] = paired_ratio(times["wc"], times["soft"])
    return result


if __name__ == "__main__":
    main()
