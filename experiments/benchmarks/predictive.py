"""Posterior samples of a trained BAM-WC GAT on Cora: predictions and attention of every node.

    python -m experiments.bench predictive [--samples 100 --chunk 100 --checkpoint PATH]

Trains the model with the paper's preset (or loads ``--checkpoint``, written on first use), then
times ``predictive_draws`` for all nodes and both attention layers (wall time, and the process's
CPU time, which other jobs on a shared machine disturb less). ``peak_mb``: the rise of the
process's peak resident memory during sampling (Linux: the peak is reset just before).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from bam_pyro.predictive import attention_site_names, predictive_draws
from experiments.benchmarks.process import reset_peak, resident_mb
from experiments.gat import settings_for, train_node_classifier
from experiments.planetoid import load_planetoid
from experiments.runs import whole_number


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=whole_number(1), default=100)
    p.add_argument("--chunk", type=whole_number(1), default=100)
    p.add_argument("--repeats", type=whole_number(1), default=3, help="timed repeats; the fastest is reported")
    p.add_argument("--threads", type=whole_number(1), default=1)
    p.add_argument("--data-root", default=None)
    p.add_argument("--checkpoint", type=Path, default=Path("runs/bench/cora-wc-0.pt"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data, num_features, num_classes = load_planetoid("cora", args.data_root)
    settings = settings_for("cora", "wc", 0, {})
    if args.checkpoint.exists():
        model = settings.build_model(num_features, num_classes)
        model.load_state_dict(torch.load(args.checkpoint))
    else:
        model, _ = train_node_classifier(settings, data, num_features, num_classes, progress=False)
        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), args.checkpoint)
    layers = attention_site_names(model)
    times, cpu = [], []
    base = resident_mb()
    reset_peak()
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.no_grad():
            draws = predictive_draws(model, (data.x, data.edge_index), args.samples, layers=layers, chunk_size=args.chunk)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        del draws
    result = dict(
        benchmark="predictive", model="BAM-WC GAT", dataset="cora", nodes=int(data.num_nodes),
        samples=args.samples, chunk=args.chunk, layers=layers, threads=args.threads,
        seconds=round(min(times), 3), seconds_all=[round(t, 3) for t in times],
        cpu_seconds=round(min(cpu), 3),
        peak_mb=round(resident_mb("VmHWM") - base, 1), load_avg_1min=os.getloadavg()[0],
    )
    print(json.dumps(result))
    return result
