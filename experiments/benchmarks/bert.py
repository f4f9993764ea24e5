"""Finetuning step of a pretrained transformer: soft attention vs BAM-WC, on the same batch.

    python -m experiments.bench bert [--model PATH_OR_NAME --batch 16 --length 128 --steps 10]

Prints one JSON line: median SVI step time (``soft_ms``, ``bam_ms``, ``time_ratio``) and peak
memory (``soft_peak_mb``, ``bam_peak_mb``, ``mem_ratio``). Times come from one fresh process where
both models take their steps in turn (so that both see the same machine conditions); memory from
one fresh process per variant that returns freed blocks to the OS (as in ``experiments.bench gat``,
see :mod:`experiments.benchmarks.process`). The peak reported is the peak resident set during setup
and two training steps minus the resident set right after the imports, i.e. the memory of the
model, the optimizer and the training step (``*_rss_mb`` give the peaks themselves).
The soft model is the unmodified transformers model (its default attention); BAM-WC swaps in
Bayesian attention through :func:`bam_pyro.transformers.to_bam`. Both train with
:class:`~bam_pyro.training.SVITrainer`'s default ELBO, as ``experiments.glue`` does.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Optional

from experiments.benchmarks.process import (
    RETURN_FREED_BLOCKS, in_fresh_process, interleaved_step_ms, soft_and_bam_figures, two_step_peak_mb,
)
from experiments.runner import whole_number
from bam_pyro.transformers import DEFAULT_MODEL, resolve_pretrained


def _training_step(variant: str, model: str, batch: int, length: int, k: float) -> Callable[[], float]:
    """One SVI step of ``variant`` on a fixed random batch (seeded: the same batch for every variant)."""
    import torch

    from bam_pyro import BamConfig, ObjectiveConfig
    from bam_pyro.training import SVITrainer, seed_everything
    from bam_pyro import AttentionGuide
    from bam_pyro.transformers import build_sequence_model

    seed_everything(0)
    config = BamConfig(variant=variant, k=k, beta=1e-2, d_mid=5)
    bam_model = build_sequence_model(model, 2, config, ObjectiveConfig())
    optimizer = torch.optim.AdamW(bam_model.parameters(), lr=2e-5)
    trainer = SVITrainer(bam_model, AttentionGuide(bam_model.model), optimizer)
    vocab = bam_model.network.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (batch, length), generator=generator)
    args = (ids, torch.ones_like(ids), torch.zeros_like(ids))
    labels = torch.randint(0, 2, (batch,), generator=generator)
    return lambda: trainer.step(*args, labels=labels)


def measure_time(variants: list[str], model: str, batch: int, length: int, steps: int, warmup: int, threads: int, k: float) -> dict[str, float]:
    """Median step time (ms) of each variant, the variants taking their steps in turn."""
    import torch

    torch.set_num_threads(threads)
    return interleaved_step_ms({v: _training_step(v, model, batch, length, k) for v in variants}, steps, warmup)


def measure_memory(variant: str, model: str, batch: int, length: int, threads: int, k: float) -> dict[str, float]:
    """Peak memory (MB) of setting up ``variant`` and taking two steps, above the imports."""
    import torch

    torch.set_num_threads(threads)
    return two_step_peak_mb(lambda: _training_step(variant, model, batch, length, k))


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.bench bert", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="local folder or hub name (default: the MiniLM package)")
    p.add_argument("--batch", type=whole_number(1), default=16)
    p.add_argument("--length", type=whole_number(1), default=128)
    p.add_argument("--steps", type=whole_number(1), default=10)
    p.add_argument("--warmup", type=whole_number(0), default=2)
    p.add_argument("--threads", type=whole_number(1), default=1, help="torch threads per process")
    p.add_argument("--k", type=float, default=10.0, help="Weibull shape of BAM-WC")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = resolve_pretrained(args.model)
    ms = in_fresh_process(measure_time, (["soft", "wc"], model, args.batch, args.length, args.steps, args.warmup, args.threads, args.k))
    soft, bam = (
        {"ms": ms[variant], **in_fresh_process(measure_memory, (variant, model, args.batch, args.length, args.threads, args.k),
                                                RETURN_FREED_BLOCKS)}
        for variant in ("soft", "wc")
    )
    result = {
        "model": args.model, "batch": args.batch, "length": args.length, "threads": args.threads,
        **soft_and_bam_figures(soft, bam),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
