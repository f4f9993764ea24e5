"""Training step of the easy-VQA MCAN: soft attention vs BAM-WC, on the same batch of real questions.

    python -m experiments.bench vqa [--batch 128 --steps 10 --threads 1 --train-images N]

Prints one JSON line: median SVI step time (``soft_ms``, ``bam_ms``, ``time_ratio``), the training
minutes per epoch those imply (the full training split, steps only), and peak memory
(``soft_peak_mb``, ``bam_peak_mb``, ``mem_ratio``). Times come from one fresh process where both
models take their steps in turn (so that both see the same machine conditions); memory from one
fresh process per variant that returns freed blocks to the OS (see
:mod:`experiments.runner.benchmarking`). The peak reported is the peak resident set while building
the model and taking two steps minus the resident set before (the data already loaded), i.e. the
memory of the model, the optimizer and the training step (``*_rss_mb`` give the peaks themselves).
Both models have the task's default sizes and presets (``experiments.vqa``; BAM-WC: k=1000,
beta=1e-6, d_mid=20) and train with :class:`~bam_pyro.training.SVITrainer`'s default ELBO.

Memory measurements run in a fresh process on the CPU and in the benchmark's own process on a GPU
(:func:`~experiments.runner.benchmarking.memory_measurement`).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Callable, Optional

from experiments.runner.benchmarking import (
    add_device_option, add_profile_option, check_profile_option, in_fresh_process, interleaved_step_ms, memory_measurement,
    operator_profile, soft_and_bam_figures, synchronized, to_device, two_step_peak_mb,
)
from experiments.runner import whole_number


def _training_step(variant: str, data, batch: int, device: str = "cpu") -> Callable[[], float]:
    """One SVI step of ``variant`` on the first ``batch`` training questions."""
    import torch

    from bam_pyro import AttentionGuide
    from bam_pyro.training import SVITrainer, seed_everything
    from experiments.vqa.task import TASK, build_model

    settings = TASK.settings_for("easy-vqa", variant, 0, {"batch_size": batch})
    seed_everything(0)
    model = build_model(settings, data).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr, betas=(0.9, 0.98))
    trainer = SVITrainer(model, AttentionGuide(model.model), optimizer)
    rows = torch.arange(batch)
    args = to_device((data.train.question_words(rows), data.train.question_images(rows)), device)
    answers = data.train.answers[rows].to(device)
    return synchronized(device, lambda: trainer.step(*args, answers=answers))


def measure_time(variants: list[str], batch: int, steps: int, warmup: int, threads: int, images: Optional[int],
                 device: str = "cpu", profile: int = 0) -> dict[str, Any]:
    """Median step time (ms) of each variant, the variants taking their steps in turn; the
    training split's size; with ``profile``, that many more steps of each profiled (:func:`operator_profile`)."""
    import torch

    from experiments.vqa.easy_vqa import load_easy_vqa

    torch.set_num_threads(threads)
    data = load_easy_vqa(train_images=images)
    step_of = {variant: _training_step(variant, data, batch, device) for variant in variants}
    timing = {"train_questions": len(data.train), **interleaved_step_ms(step_of, steps, warmup)}
    if profile:
        timing["profile"] = operator_profile(step_of, profile, ("soft", "wc"))
    return timing


def measure_memory(variant: str, batch: int, threads: int, images: Optional[int], device: str = "cpu") -> dict[str, float]:
    """Peak memory (MB) of building ``variant`` and taking two steps, above the loaded data."""
    import torch

    from experiments.vqa.easy_vqa import load_easy_vqa

    torch.set_num_threads(threads)
    data = load_easy_vqa(train_images=images)
    return two_step_peak_mb(lambda: _training_step(variant, data, batch, device), device)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.bench vqa", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=whole_number(1), default=128)
    p.add_argument("--steps", type=whole_number(1), default=10)
    p.add_argument("--warmup", type=whole_number(0), default=2)
    p.add_argument("--threads", type=whole_number(1), default=1, help="torch threads per process")
    p.add_argument("--train-images", type=whole_number(2), default=None,
                   help="load only N training images (a quick check; the epoch minutes are then those of the subset)")
    add_device_option(p)
    add_profile_option(p)
    args = p.parse_args(argv)
    check_profile_option(p, args)
    timing = in_fresh_process(measure_time, (["soft", "wc"], args.batch, args.steps, args.warmup, args.threads, args.train_images,
                                             args.device, args.profile))
    soft, bam = (
        {"ms": timing[variant], **memory_measurement(measure_memory, (variant, args.batch, args.threads, args.train_images,
                                                                      args.device), args.device)}
        for variant in ("soft", "wc")
    )
    steps_per_epoch = math.ceil(timing["train_questions"] / args.batch)
    result = {
        "batch": args.batch, "threads": args.threads, "device": args.device, "train_questions": timing["train_questions"],
        "steps_per_epoch": steps_per_epoch,
        **soft_and_bam_figures(soft, bam),
        "soft_epoch_minutes": round(steps_per_epoch * soft["ms"] / 60_000, 2),
        "bam_epoch_minutes": round(steps_per_epoch * bam["ms"] / 60_000, 2),
        **({"profile": timing["profile"]} if args.profile else {}),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
