"""Posterior samples of a trained BAM-WC GAT on Cora: predictions and attention of every node.

    python -m experiments.bench predictive [--samples 100 --chunk 100 --checkpoint PATH]

Trains the model with the paper's preset (or loads ``--checkpoint``, written on first use), then,
in a fresh process that loads the checkpoint, times ``predictive_draws`` for all nodes and both
attention layers (wall time, and the process's CPU time, which other jobs on a shared machine
disturb less). Each repeat samples twice in turn: with the draws summed in bags (``seconds``,
the library's path) and with PyG's ``propagate`` (``propagate_seconds``, the path before issue 44,
:func:`bam_pyro.pyg.set_bag_draws`); ``propagate_over_bags`` is the ratio of the fastest of each,
``propagate_over_bags_all`` that of each repeat. ``peak_mb`` (``propagate_peak_mb``): the rise of
that process's peak resident memory during one sampling (Linux: the peak is reset just before; on
a GPU the allocator's peak), bags first, in a fresh process, so that memory cached by training
does not hide it. A warm-up sampling each way precedes the timed repeats. ``--device`` moves the
sampling; the training runs on the CPU. ``--untrained`` samples the freshly initialized model
instead (the cost of sampling does not depend on the weights; the GPU check uses it, having no
minute to spare for training on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from bam_pyro.predictive import attention_site_names, predictive_draws
from bam_pyro.pyg import set_bag_draws
from experiments.runner.benchmarking import add_device_option, in_fresh_process, step_peak_mb
from experiments.gat.task import TASK, build_model, train_classifier
from experiments.gat.planetoid import load_planetoid
from experiments.runner import RunContext, whole_number


def measure_sampling(checkpoint: Path, data_root: Optional[str], samples: int, chunk: int, repeats: int, threads: int,
                     device: str = "cpu") -> dict:
    """Wall and CPU seconds of each repeat of sampling, the draws summed in bags (``times``) and
    with PyG's propagate (``old_times``, :func:`bam_pyro.pyg.set_bag_draws`) in turn, and the
    rise of the peak memory of one sampling each way (resident on the CPU, allocated on a GPU)."""
    torch.set_num_threads(threads)
    data, num_features, num_classes = load_planetoid("cora", data_root)
    model = build_model(TASK.settings_for("cora", "wc", 0, {}), num_features, num_classes)
    model.load_state_dict(torch.load(checkpoint, weights_only=True))
    model.to(device)
    inputs = (data.x.to(device), data.edge_index.to(device))
    layers = attention_site_names(model)
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}

    def sample(bags: bool) -> None:
        set_bag_draws(model, bags)
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.no_grad():
            draws = predictive_draws(model, inputs, samples, layers=layers, chunk_size=chunk)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        times[bags].append(time.perf_counter() - start)
        cpu[bags].append(time.process_time() - cpu_start)
        del draws

    peak = step_peak_mb(lambda: sample(True), device)  # first, in a fresh process
    peak_old = step_peak_mb(lambda: sample(False), device)
    for _ in range(repeats):  # in turn, so that the load of a shared machine falls on both alike
        sample(False)
        sample(True)
    return {"nodes": int(data.num_nodes), "layers": layers, "times": times[True][1:], "cpu": cpu[True][1:],
            "old_times": times[False][1:], "old_cpu": cpu[False][1:], "peak_mb": peak, "peak_mb_old": peak_old}


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=whole_number(1), default=100)
    p.add_argument("--chunk", type=whole_number(1), default=100)
    p.add_argument("--repeats", type=whole_number(1), default=3, help="timed repeats; the fastest is reported")
    p.add_argument("--threads", type=whole_number(1), default=1)
    p.add_argument("--data-root", default=None)
    p.add_argument("--checkpoint", type=Path, default=Path("runs/bench/cora-wc-0.pt"))
    p.add_argument("--untrained", action="store_true", help="sample the initialized model (no training; no checkpoint read)")
    add_device_option(p)
    args = p.parse_args(argv)
    settings = TASK.settings_for("cora", "wc", 0, {})
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-predictive-") as scratch:
        checkpoint = args.checkpoint
        if args.untrained:  # a file of its own: an untrained model must never pass for the trained one
            checkpoint = Path(scratch) / "untrained.pt"
            torch.save(build_model(settings, *load_planetoid("cora", args.data_root)[1:]).state_dict(), checkpoint)
        elif not checkpoint.exists():
            model = train_classifier(settings, load_planetoid("cora", args.data_root),
                                     RunContext(checkpoint.parent / "training", settings, progress=False))
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), checkpoint)
        measured = in_fresh_process(
            measure_sampling, (checkpoint, args.data_root, args.samples, args.chunk, args.repeats, args.threads, args.device)
        )
    times, cpu, old = measured["times"], measured["cpu"], measured["old_times"]
    result = dict(
        benchmark="predictive", model="BAM-WC GAT", trained=not args.untrained, dataset="cora", nodes=measured["nodes"],
        samples=args.samples, chunk=args.chunk, layers=measured["layers"], threads=args.threads, device=args.device,
        seconds=round(min(times), 3), seconds_all=[round(t, 3) for t in times],
        cpu_seconds=round(min(cpu), 3), peak_mb=round(measured["peak_mb"], 1),
        propagate_seconds=round(min(old), 3), propagate_seconds_all=[round(t, 3) for t in old],
        propagate_cpu_seconds=round(min(measured["old_cpu"]), 3), propagate_peak_mb=round(measured["peak_mb_old"], 1),
        propagate_over_bags=round(min(old) / min(times), 3),
        propagate_over_bags_all=[round(o / t, 3) for o, t in zip(old, times)],
        load_avg_1min=os.getloadavg()[0],
    )
    print(json.dumps(result))
    return result
