"""Finetuning step of a transformer: soft attention vs BAM-WC, on the same batch, at several lengths.

    python -m experiments.bench bert [--model PATH_OR_NAME --shapes 16x128 4x512 --steps 10]
    python -m experiments.bench bert --model random-bert --layers 1 --shapes 1x2048 1x8192 --steps 3
    python -m experiments.bench bert --compile --shapes 16x128 --steps 12     both models compiled and eager
    python -m experiments.bench bert --device cuda                             on a GPU

Prints one JSON line per shape (batch x length): the median SVI step time of each variant
(``soft_ms``, ``bam_ms``), the median of the per-step time ratios BAM-WC / soft (``time_ratio``)
with their interquartile range (``time_ratio_iqr``), and peak memory (``soft_peak_mb``,
``bam_peak_mb``, ``mem_ratio``). Times come from one fresh process where the two models take
their steps in turn (soft, BAM, soft, BAM, ...), so that each ratio compares two steps taken
under the same machine conditions; memory from one fresh process per variant that returns freed
blocks to the OS (see :mod:`experiments.runner.benchmarking`). The peak reported is the peak
resident set during setup and two training steps minus the resident set right after the
imports, i.e. the memory of the model, the optimizer and the training step (``*_rss_mb`` give
the peaks themselves).

``--model random-bert`` is a randomly initialized BERT-base-sized encoder (hidden 768, 12 heads,
intermediate 3072, the MiniLM tokenizer's vocabulary, positions up to the longest shape) with
``--layers`` layers: few, so that a step at 8192 tokens takes seconds to a minute on one CPU
thread. The soft model is the unmodified transformers model (its default attention, sdpa); BAM-WC
swaps in Bayesian attention through :func:`bam_pyro.transformers.to_bam`, on its fused path (no
attention map; ``--materialized`` keeps the maps). Both train with
:class:`~bam_pyro.training.SVITrainer`'s default ELBO, Pyro's validation off (its checks of the
first step would evaluate every site's log-density, a full map). ``--compile`` runs both
transformers models through ``torch.compile`` (Inductor, with :data:`COMPILE_OPTIONS`) and adds both eager models to the same
round of steps: ``bam_compiled_over_eager`` (``soft_compiled_over_eager``) is the median and
interquartile range of the per-step ratios compiled / eager BAM-WC (soft), taken back to back. ``--compiled-noise`` draws the fused
path's noise through it (:func:`bam_pyro.fused.compile_noise`) in the timing process (the warmup
steps take the compilation), while the memory processes draw it eagerly: the tensors are the
same, and the compiler's own memory is not the method's. ``--device cuda`` builds the models and
the batch on a GPU: times wait for its kernels, memory is the caching allocator's peak.

Memory measurements run in a fresh process on the CPU and in the benchmark's own process on a GPU
(:func:`~experiments.runner.benchmarking.memory_measurement`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable, Optional

from experiments.runner.benchmarking import (
    add_device_option, add_profile_option, check_profile_option, in_fresh_process, memory_measurement, operator_profile,
    soft_and_bam_figures, synchronized, two_step_peak_mb,
)
from experiments.runner import whole_number
from bam_pyro.transformers import DEFAULT_MODEL, resolve_pretrained

#: ``--model`` value of the randomly initialized BERT-base-sized model
RANDOM_BERT = "random-bert"
#: Inductor options of ``--compile``: ATen's random draws for dropout. With Inductor's own (Philox,
#: one draw per element in the generated loop) the compiled soft MiniLM step took 1.23x its eager
#: step on the 2-core CPU, with ATen's 0.99 to 1.02 (``--compile --shapes 16x128``, 27 Nov; the
#: benchmarks page)
COMPILE_OPTIONS = {"fallback_random": True}


def parse_shape(text: str) -> tuple[int, int]:
    """``"16x128"`` -> (16, 128): batch x length, both whole numbers >= 1."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape must be BATCHxLENGTH with whole numbers >= 1, got {text!r}")
    return int(parts[0]), int(parts[1])


def _network(model: str, layers: int, length: int):
    """The transformers classifier to finetune: a local folder or hub name, or the random BERT-size model."""
    if model != RANDOM_BERT:
        return model
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    vocab = AutoTokenizer.from_pretrained(resolve_pretrained(DEFAULT_MODEL)).vocab_size
    config = BertConfig(vocab_size=vocab, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                        num_hidden_layers=layers, max_position_embeddings=max(512, length), num_labels=2)
    return BertForSequenceClassification(config)


def _training_step(variant: str, model: str, layers: int, batch: int, length: int, k: float, fused: bool,
                   compile_model: bool, compiled_noise: bool = False, device: str = "cpu") -> Callable[[], float]:
    """One SVI step of ``variant`` on a fixed random batch (seeded: the same batch and initial
    weights for every variant)."""
    import pyro
    import torch

    from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
    from bam_pyro.attention import set_fused
    from bam_pyro.fused import compile_noise
    from bam_pyro.training import SVITrainer, seed_everything
    from bam_pyro.transformers import build_sequence_model

    pyro.enable_validation(False)
    seed_everything(0)
    config = BamConfig(variant=variant, k=k, beta=1e-2, d_mid=5)
    bam_model = build_sequence_model(_network(model, layers, length), 2, config, ObjectiveConfig()).to(device)
    set_fused(bam_model, fused)
    if compile_model:
        bam_model.network.model.forward = torch.compile(bam_model.network.model.forward, options=COMPILE_OPTIONS)
    optimizer = torch.optim.AdamW(bam_model.parameters(), lr=2e-5)
    trainer = SVITrainer(bam_model, AttentionGuide(bam_model.model), optimizer)
    vocab = bam_model.network.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (batch, length), generator=generator)
    args = tuple(t.to(device) for t in (ids, torch.ones_like(ids), torch.zeros_like(ids)))
    labels = torch.randint(0, 2, (batch,), generator=generator).to(device)

    def step() -> float:
        with compile_noise(compiled_noise):
            return trainer.step(*args, labels=labels)

    return synchronized(device, step)


def measure_time(model: str, layers: int, batch: int, length: int, steps: int, warmup: int, threads: int, k: float,
                 fused: bool, compile_model: bool, compiled_noise: bool, device: str = "cpu", profile: int = 0) -> dict[str, Any]:
    """Step times of soft and BAM-WC taken in turn: their medians (ms) and the per-step ratios
    BAM-WC / soft; with ``compile_model`` eager BAM-WC takes its steps in the same round, and the
    ratios compiled / eager BAM-WC come too; with ``profile``, that many more steps of each
    profiled (:func:`operator_profile`)."""
    import torch

    torch.set_num_threads(threads)
    step_of = {v: _training_step(v, model, layers, batch, length, k, fused, compile_model, compiled_noise, device)
               for v in ("soft", "wc")}
    if compile_model:
        for variant in ("soft", "wc"):
            step_of[f"{variant}-eager"] = _training_step(variant, model, layers, batch, length, k, fused, False,
                                                         compiled_noise, device)
    times: dict[str, list[float]] = {v: [] for v in step_of}
    for step in range(warmup + steps):
        for variant, training_step in step_of.items():
            start = time.perf_counter()
            training_step()
            if step >= warmup:
                times[variant].append(1000 * (time.perf_counter() - start))
    result = {"soft_ms": statistics.median(times["soft"]), "bam_ms": statistics.median(times["wc"]),
              "ratios": [b / s for s, b in zip(times["soft"], times["wc"])]}
    if compile_model:
        for variant, name in (("soft", "soft"), ("wc", "bam")):
            result[f"{name}_eager_ms"] = statistics.median(times[f"{variant}-eager"])
            result[f"{name}_compiled_over_eager"] = [c / e for c, e in zip(times[variant], times[f"{variant}-eager"])]
    if profile:
        result["profile"] = operator_profile(step_of, profile, ("soft", "wc"))
    return result


def measure_memory(variant: str, model: str, layers: int, batch: int, length: int, threads: int, k: float, fused: bool,
                   compile_model: bool, device: str = "cpu") -> dict[str, float]:
    """Peak memory (MB) of setting up ``variant`` and taking two steps, above the imports."""
    import torch

    torch.set_num_threads(threads)
    return two_step_peak_mb(lambda: _training_step(variant, model, layers, batch, length, k, fused, compile_model,
                                                   device=device), device)


def ratio_summary(ratios: list[float], name: str = "time_ratio") -> dict[str, Any]:
    """Median and interquartile range of per-step ratios (the range is the ratios' own with fewer than 4)."""
    if len(ratios) >= 4:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
    else:
        q1, q3 = min(ratios), max(ratios)
    return {name: round(statistics.median(ratios), 3), f"{name}_iqr": [round(q1, 3), round(q3, 3)]}


def bench_shape(args: argparse.Namespace, model: str, batch: int, length: int) -> dict[str, Any]:
    common = (model, args.layers, batch, length)
    timing = in_fresh_process(measure_time, common + (args.steps, args.warmup, args.threads, args.k, not args.materialized,
                                                      args.compile, args.compiled_noise, args.device, args.profile))
    soft, bam = (
        {"ms": timing[f"{name}_ms"],
         **memory_measurement(measure_memory, (variant,) + common + (args.threads, args.k, not args.materialized, args.compile,
                                                                    args.device), args.device)}
        for name, variant in (("soft", "soft"), ("bam", "wc"))
    )
    figures = soft_and_bam_figures(soft, bam)
    result = {
        "model": args.model, "layers": args.layers if args.model == RANDOM_BERT else None, "batch": batch, "length": length,
        "threads": args.threads, "steps": args.steps, "device": args.device,
        "path": "materialized" if args.materialized else "fused", "compiled": args.compile,
        "compiled_noise": args.compiled_noise, "compile_options": COMPILE_OPTIONS if args.compile else None, **figures, **ratio_summary(timing["ratios"]),
    }
    if args.compile:
        for name in ("soft", "bam"):
            result[f"{name}_eager_ms"] = round(timing[f"{name}_eager_ms"], 1)
            result.update(ratio_summary(timing[f"{name}_compiled_over_eager"], f"{name}_compiled_over_eager"))
    if args.profile:
        result["profile"] = timing["profile"]
    return result


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m experiments.bench bert", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"local folder, hub name or {RANDOM_BERT!r} (default: the MiniLM package)")
    p.add_argument("--layers", type=whole_number(1), default=1, help=f"layers of {RANDOM_BERT}")
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=[(16, 128)], help="BATCHxLENGTH ... (default 16x128)")
    p.add_argument("--batch", type=whole_number(1), help="with --length: one shape (as --shapes BATCHxLENGTH)")
    p.add_argument("--length", type=whole_number(1))
    p.add_argument("--steps", type=whole_number(1), default=10)
    p.add_argument("--warmup", type=whole_number(0), default=2)
    p.add_argument("--threads", type=whole_number(1), default=1, help="torch threads per process")
    p.add_argument("--k", type=float, default=10.0, help="Weibull shape of BAM-WC")
    p.add_argument("--materialized", action="store_true", help="BAM-WC on the materialized path (attention maps)")
    p.add_argument("--compile", action="store_true", help="torch.compile both transformers models")
    p.add_argument("--compiled-noise", action="store_true",
                   help="draw the fused path's noise through torch.compile (bam_pyro.fused.compile_noise); timing only")
    add_device_option(p)
    add_profile_option(p)
    args = p.parse_args(argv)
    check_profile_option(p, args)
    if (args.batch is None) != (args.length is None):
        p.error("--batch and --length go together")
    shapes = [(args.batch, args.length)] if args.batch is not None else args.shapes
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model if args.model == RANDOM_BERT else resolve_pretrained(args.model)
    results = []
    for batch, length in shapes:
        result = bench_shape(args, model, batch, length)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
