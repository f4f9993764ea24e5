"""Finetuning step of a pretrained transformer: soft attention vs BAM-WC, on the same batch.

    python -m experiments.bench bert [--model PATH_OR_NAME --batch 16 --length 128 --steps 10]

Prints one JSON line: median SVI step time (``soft_ms``, ``bam_ms``, ``time_ratio``) and peak
memory (``soft_peak_mb``, ``bam_peak_mb``, ``mem_ratio``). Each variant is timed in one fresh
process and measured for memory in another, so that a process's peak resident memory is its own.
The memory process runs with glibc handing every block of 64 KiB or more straight back to the OS
(``MALLOC_MMAP_THRESHOLD_``, as in ``experiments.bench gat``), so that resident memory follows
live tensors rather than the allocator's cache; the peak reported is the peak resident set during
setup and training minus the resident set right after the imports, i.e. the memory of the model,
the optimizer and the training step (``*_rss_mb`` give the raw process peaks). That setting slows
allocation down, which is why the times come from the other process.
The soft model is the unmodified transformers model (its default attention); BAM-WC swaps in
Bayesian attention through :func:`models.transformers_bam.to_bam`. Both train with
:class:`~bam_pyro.training.SVITrainer`'s default ELBO, as ``experiments.glue`` does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import time
from typing import Any, Optional

from models.transformers_bam import DEFAULT_MODEL, resolve_pretrained

def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def measure(variant: str, model: str, batch: int, length: int, steps: int, warmup: int, threads: int, k: float) -> dict[str, float]:
    """Median step time (ms) and peak memory (MB) of ``steps`` SVI steps after ``warmup`` steps."""
    import torch

    from bam_pyro import BamConfig, ObjectiveConfig
    from bam_pyro.training import SVITrainer, seed_everything
    from guides import AttentionGuide
    from models.transformers_bam import build_sequence_model

    torch.set_num_threads(threads)
    base = _rss_mb()
    seed_everything(0)
    config = BamConfig(variant=variant, k=k, beta=1e-2, d_mid=5)
    bam_model = build_sequence_model(model, 2, config, ObjectiveConfig())
    optimizer = torch.optim.AdamW(bam_model.parameters(), lr=2e-5)
    trainer = SVITrainer(bam_model, AttentionGuide(bam_model.model), optimizer)
    vocab = bam_model.network.model.config.vocab_size
    ids = torch.randint(1000, vocab, (batch, length))
    args = (ids, torch.ones_like(ids), torch.zeros_like(ids))
    labels = torch.randint(0, 2, (batch,))
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        trainer.step(*args, labels=labels)
        if step >= warmup:
            times.append(1000 * (time.perf_counter() - start))
    return {"ms": statistics.median(times), "peak_mb": _peak_rss_mb() - base, "rss_mb": _peak_rss_mb()}


def _in_fresh_process(variant: str, options: dict[str, Any], environment: Optional[dict[str, str]] = None) -> dict[str, float]:
    """``measure`` in a new process started with ``environment`` added to this one's."""
    saved = dict(os.environ)
    os.environ.update(environment or {})
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(measure, (variant,), options)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _time_and_memory(variant: str, options: dict[str, Any]) -> dict[str, float]:
    timed = _in_fresh_process(variant, options)
    memory = _in_fresh_process(variant, {**options, "steps": 1, "warmup": 1}, {"MALLOC_MMAP_THRESHOLD_": "65536"})
    return {"ms": timed["ms"], "peak_mb": memory["peak_mb"], "rss_mb": memory["rss_mb"]}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.bench bert", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="local folder or hub name (default: the MiniLM package)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--k", type=float, default=10.0, help="Weibull shape of BAM-WC")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    options = dict(model=resolve_pretrained(args.model), batch=args.batch, length=args.length, steps=args.steps,
                   warmup=args.warmup, threads=args.threads, k=args.k)
    soft, bam = _time_and_memory("soft", options), _time_and_memory("wc", options)
    result = {
        "model": args.model, "batch": args.batch, "length": args.length, "threads": args.threads,
        "soft_ms": round(soft["ms"], 1), "bam_ms": round(bam["ms"], 1),
        "time_ratio": round(bam["ms"] / soft["ms"], 3),
        "soft_peak_mb": round(soft["peak_mb"], 1), "bam_peak_mb": round(bam["peak_mb"], 1),
        "mem_ratio": round(bam["peak_mb"] / soft["peak_mb"], 3),
        "soft_rss_mb": round(soft["rss_mb"], 1), "bam_rss_mb": round(bam["rss_mb"], 1),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
