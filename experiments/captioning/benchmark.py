"""Training step of Att2in captioning: soft attention vs BAM-WC, on the same batches of real captions.

    python -m experiments.bench captioning [--batch 50 --steps 20 --threads 1 --memory-repeats 3 --device cpu]

Prints one JSON line. Time: one fresh process where both models take their steps in turn on the
same batch (soft, BAM, soft, BAM, ...: both see the same machine conditions); ``time_ratio`` is the
median of the per-step ratios BAM / soft and ``time_ratio_iqr`` their interquartile range, beside
each model's median step (``soft_ms``, ``bam_ms``). Memory: the peak resident memory of building the
model and taking two steps above the loaded data, in one fresh process per variant and repeat (see
:mod:`experiments.runner.benchmarking`); ``mem_ratio`` is the median over repeats of BAM / soft
(``mem_ratio_range``: lowest and highest). Both models have the task's default sizes and presets
(:mod:`experiments.captioning`; BAM-WC: k=10, beta=1e-6, d_mid=10) on the Flickr8k subset's
features (cached by :mod:`experiments.captioning.features`), and train with the task's ELBO.

Memory measurements run in a fresh process on the CPU and in the benchmark's own process on a GPU
(:func:`~experiments.runner.benchmarking.memory_measurement`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Optional

from experiments.runner.benchmarking import (
    add_device_option, add_profile_option, check_profile_option, in_fresh_process, interleaved_step_ms, memory_measurement,
    operator_profile, synchronized, to_device, two_step_peak_mb,
)
from experiments.runner import whole_number

VARIANTS = ("soft", "wc")


def _training_step(variant: str, data, batch: int, device: str = "cpu") -> Callable[[], float]:
    """One SVI step of ``variant`` on the first ``batch`` training captions, on ``device``."""
    import torch

    from bam_pyro.training import SVITrainer, seed_everything
    from experiments.captioning.task import TASK, build_trainable

    settings = TASK.settings_for("flickr8k", variant, 0, {"batch_size": batch})
    seed_everything(0)
    trainable = build_trainable(settings, data)
    trainable.model.to(device)
    optimizer = torch.optim.Adam(trainable.model.parameters(), lr=settings.lr, fused=True)
    trainer = SVITrainer(trainable.model, trainable.guide, optimizer, elbo=trainable.elbo, grad_clip=settings.grad_clip)
    args, kwargs = to_device(data.train.batch(torch.arange(batch)).model_args, device)
    return synchronized(device, lambda: trainer.step(*args, **kwargs))


def _load(threads: int):
    import torch

    from experiments.captioning.task import TASK, load_data

    torch.set_num_threads(threads)
    return load_data(TASK.settings_for("flickr8k", "soft", 0, {}), None)


def measure_time(batch: int, steps: int, warmup: int, threads: int, device: str = "cpu", profile: int = 0) -> dict[str, Any]:
    """Every timed step (ms) of each variant, the variants taking their steps in turn; with
    ``profile``, that many more steps of each profiled (``"profile"``, :func:`operator_profile`)."""
    data = _load(threads)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    step_of = {variant: _training_step(variant, data, batch, device) for variant in VARIANTS}

    def timed(variant: str) -> Callable[[], None]:
        def run() -> None:
            start = time.perf_counter()
            step_of[variant]()
            times[variant].append(1000 * (time.perf_counter() - start))

        return run

    interleaved_step_ms({variant: timed(variant) for variant in VARIANTS}, steps, warmup)
    timing: dict[str, Any] = {variant: t[warmup:] for variant, t in times.items()}
    if profile:
        timing["profile"] = operator_profile(step_of, profile, ("soft", "wc"))
    return timing


def measure_memory(variant: str, batch: int, threads: int, device: str = "cpu") -> dict[str, float]:
    """Peak memory (MB) of building ``variant`` and taking two steps, above the loaded data."""
    data = _load(threads)
    return two_step_peak_mb(lambda: _training_step(variant, data, batch, device), device)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.bench captioning", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=whole_number(1), default=50)
    p.add_argument("--steps", type=whole_number(2), default=20)
    p.add_argument("--warmup", type=whole_number(0), default=2)
    p.add_argument("--threads", type=whole_number(1), default=1, help="torch threads per process")
    p.add_argument("--memory-repeats", type=whole_number(1), default=3, help="fresh processes per variant for memory")
    add_device_option(p)
    add_profile_option(p)
    args = p.parse_args(argv)
    check_profile_option(p, args)
    times = in_fresh_process(measure_time, (args.batch, args.steps, args.warmup, args.threads, args.device, args.profile))
    ratios = [bam / soft for soft, bam in zip(times["soft"], times["wc"])]
    q1, ratio, q3 = quartiles(ratios)
    peaks = {variant: [memory_measurement(measure_memory, (variant, args.batch, args.threads, args.device), args.device)["peak_mb"]
                       for _ in range(args.memory_repeats)] for variant in VARIANTS}
    memory_ratios = [bam / soft for soft, bam in zip(peaks["soft"], peaks["wc"])]
    result = {
        "batch": args.batch, "threads": args.threads, "device": args.device, "steps": args.steps,
        "soft_ms": round(statistics.median(times["soft"]), 1), "bam_ms": round(statistics.median(times["wc"]), 1),
        "time_ratio": round(ratio, 3), "time_ratio_iqr": [round(q1, 3), round(q3, 3)],
        "soft_peak_mb": round(statistics.median(peaks["soft"]), 1), "bam_peak_mb": round(statistics.median(peaks["wc"]), 1),
        "mem_ratio": round(statistics.median(memory_ratios), 3),
        "mem_ratio_range": [round(min(memory_ratios), 3), round(max(memory_ratios), 3)],
        **({"profile": times["profile"]} if args.profile else {}),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
