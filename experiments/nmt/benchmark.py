"""Training step of the translation model: soft attention against BAM-WC (and any other variant).

    python -m experiments.bench nmt [--preset cpu --batch 64 --length 16 --vocab 8000 --steps 10 --threads 1]

Prints one JSON line: the median SVI step time of every variant in :data:`BENCH_MODELS` (``soft_ms``,
``bam_ms``, ...), its peak memory (``soft_peak_mb``, ...), and BAM-WC's ratios to soft
(``time_ratio``, ``mem_ratio``). As in ``experiments.bench bert``, times come from one fresh process
where the variants take their steps in turn (the same machine conditions for all), memory from one
fresh process per variant that returns freed blocks to the OS (:mod:`experiments.runner.benchmarking`):
the peak resident set during setup and two steps, minus the resident set after the imports.

The batch is random pieces, the same for every variant: ``batch`` sentence pairs whose source and
target lengths are drawn from ``[3/4 length, length]`` (Multi30k's pieces average 15 per sentence,
and training batches group similar lengths). Each variant is built and trained as the task trains
it (:func:`experiments.nmt.task.build_trainable`, the task's presets), so a new variant is one line here.

Memory measurements run in a fresh process on the CPU and in the benchmark's own process on a GPU
(:func:`~experiments.runner.benchmarking.memory_measurement`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Optional

from experiments.runner.benchmarking import (
    add_device_option, add_profile_option, check_profile_option, in_fresh_process, interleaved_step_ms, memory_measurement,
    operator_profile, synchronized, to_device, two_step_peak_mb,
)
from experiments.runner import whole_number

#: JSON name -> task variant; ``soft`` is the baseline and ``bam`` the one the ratios compare; the
#: latent-alignment variants of Deng et al. are timed beside them
BENCH_MODELS = {"soft": "soft", "bam": "wc", **{v: v for v in ("exact", "hard", "hard-enum", "va-enum", "va-sample", "va-relaxed")}}


def _training_step(variant: str, preset: str, batch: int, length: int, vocab: int, device: str = "cpu") -> Callable[[], float]:
    """One SVI step of ``variant`` on a fixed random batch (seeded: the same batch for every variant)."""
    import torch

    from bam_pyro.training import SVITrainer, seed_everything
    from experiments.nmt.multi30k import make_batch
    from experiments.nmt.task import NmtSettings, build_trainable, make_optimizer, presets

    settings = NmtSettings(variant=variant, preset=preset, **presets("multi30k", variant))
    generator = torch.Generator().manual_seed(0)

    def sentence():
        size = int(torch.randint(max(1, 3 * length // 4), length + 1, (), generator=generator))
        return torch.randint(4, vocab, (size,), generator=generator).numpy()

    args, kwargs = to_device(make_batch([sentence() for _ in range(batch)], [sentence() for _ in range(batch)]).model_args, device)
    seed_everything(0)
    trainable = build_trainable(settings, vocab)
    trainable.model.to(device)
    optimizer = make_optimizer(settings, trainable.model)
    trainer = SVITrainer(trainable.model, trainable.guide, optimizer, elbo=trainable.elbo, grad_clip=settings.grad_clip)
    return synchronized(device, lambda: trainer.step(*args, **kwargs))


def measure_time(variants: list[str], preset: str, batch: int, length: int, vocab: int, steps: int, warmup: int,
                 threads: int, device: str = "cpu", profile: int = 0) -> dict[str, Any]:
    """Median step time (ms) of each variant, the variants taking their steps in turn; with
    ``profile``, that many more steps of each profiled (``"profile"``, :func:`operator_profile`)."""
    import torch

    torch.set_num_threads(threads)
    step_of = {variant: _training_step(variant, preset, batch, length, vocab, device) for variant in variants}
    timing: dict[str, Any] = interleaved_step_ms(step_of, steps, warmup)
    if profile:
        timing["profile"] = operator_profile(step_of, profile, (BENCH_MODELS["soft"], BENCH_MODELS["bam"]))
    return timing


def measure_memory(variant: str, preset: str, batch: int, length: int, vocab: int, threads: int, device: str = "cpu") -> float:
    """Peak memory (MB) of setting up ``variant`` and taking two steps, above the imports."""
    import torch

    import experiments.nmt.task  # noqa: F401  (imports are not the step's memory)

    torch.set_num_threads(threads)
    return two_step_peak_mb(lambda: _training_step(variant, preset, batch, length, vocab, device), device)["peak_mb"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.bench nmt", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu", help="network sizes (models.nmt.PRESETS)")
    p.add_argument("--batch", type=whole_number(1), default=64)
    p.add_argument("--length", type=whole_number(1), default=16, help="longest sentence of the batch, in pieces")
    p.add_argument("--vocab", type=whole_number(5), default=8000)
    p.add_argument("--steps", type=whole_number(1), default=10)
    p.add_argument("--warmup", type=whole_number(0), default=2)
    p.add_argument("--threads", type=whole_number(1), default=1, help="torch threads per process")
    p.add_argument("--models", nargs="+", choices=list(BENCH_MODELS), default=list(BENCH_MODELS),
                   help="what to time beside soft and bam (always measured, with their memory)")
    add_device_option(p)
    add_profile_option(p)
    args = p.parse_args(argv)
    check_profile_option(p, args)
    timed = {name: BENCH_MODELS[name] for name in dict.fromkeys(["soft", "bam", *args.models])}
    shape = (args.preset, args.batch, args.length, args.vocab)
    ms = in_fresh_process(measure_time, ([*timed.values()], *shape, args.steps, args.warmup, args.threads, args.device,
                                           args.profile))
    peak = {name: memory_measurement(measure_memory, (BENCH_MODELS[name], *shape, args.threads, args.device), args.device)
            for name in ("soft", "bam")}
    result: dict[str, Any] = {"preset": args.preset, "batch": args.batch, "length": args.length, "vocab": args.vocab,
                              "threads": args.threads, "device": args.device}
    result.update({f"{name}_ms": round(ms[variant], 1) for name, variant in timed.items()})
    result.update({f"{name}_peak_mb": round(peak[name], 1) for name in peak})
    result["time_ratio"] = round(ms[BENCH_MODELS["bam"]] / ms[BENCH_MODELS["soft"]], 3)
    result["mem_ratio"] = round(peak["bam"] / peak["soft"], 3)
    if args.profile:
        result["profile"] = ms["profile"]
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
