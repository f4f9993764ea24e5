"""What the benchmarks share: running a measurement in a fresh process, timing training steps taken
in turn, and reading memory.

CPU torch keeps no allocator statistics, so memory is read from the kernel (Linux ``/proc``). A
fresh process per measurement makes a process's peak its own; with ``RETURN_FREED_BLOCKS`` glibc
hands every block of 64 KiB or more straight back to the OS, so that resident memory follows live
tensors rather than the allocator's cache (it slows allocation, so times are taken without it).
On a GPU the caching allocator counts allocated bytes and its peak is reset per measurement, so
:func:`memory_measurement` runs there in the calling process (a fresh process costs seconds of
imports and CUDA start-up, which a GPU check of a few minutes cannot spare).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from experiments.runner.cli import whole_number

RETURN_FREED_BLOCKS = {"MALLOC_MMAP_THRESHOLD_": "65536"}
#: the last entry of an operator profile: the time of the operators not listed
OTHER_OPERATORS = "(other operators)"


def in_fresh_process(function: Callable, arguments: tuple, environment: Optional[dict[str, str]] = None) -> Any:
    """``function(*arguments)`` in a new (spawned) process with ``environment`` added to this
    one's. An exception in it is raised here, with the child's traceback attached."""
    saved = dict(os.environ)
    os.environ.update(environment or {})
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(function, *arguments).result()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def memory_measurement(function: Callable, arguments: tuple, device: str) -> Any:
    """``function(*arguments)``, a memory measurement on ``device``: in a fresh process that returns
    freed blocks to the OS on the CPU, in this process on a GPU (the allocator's peak statistics are
    reset by the measurement itself; cached blocks are emptied first)."""
    if not device.startswith("cuda"):
        return in_fresh_process(function, arguments, RETURN_FREED_BLOCKS)
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return function(*arguments)


def resident_mb(field: str = "VmRSS") -> float:
    """This process's resident memory in MB: ``VmRSS`` (now) or ``VmHWM`` (the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Lower the resident peak (``VmHWM``) to the resident memory now."""
    Path("/proc/self/clear_refs").write_text("5")


def interleaved_step_ms(step_of: dict[str, Callable[[], Any]], steps: int, warmup: int) -> dict[str, float]:
    """Median time (ms) of each named step function over ``steps`` calls after ``warmup``, the
    functions taking their steps in turn so that they share the machine's conditions."""
    times: dict[str, list[float]] = {name: [] for name in step_of}
    for step in range(warmup + steps):
        for name, training_step in step_of.items():
            start = time.perf_counter()
            training_step()
            if step >= warmup:
                times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def two_step_peak_mb(build_step: Callable[[], Callable[[], Any]], device: str = "cpu") -> dict[str, float]:
    """Peak memory (MB) of building a training step and taking it twice, above the memory before
    (``peak_mb``), and the peak itself (``rss_mb``): resident memory on the CPU, the caching
    allocator's allocated memory on a GPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        training_step = build_step()
        for _ in range(2):
            training_step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        return {"peak_mb": peak - base / 2**20, "rss_mb": peak}
    base = resident_mb()
    reset_peak()
    training_step = build_step()
    for _ in range(2):
        training_step()
    peak = resident_mb("VmHWM")
    return {"peak_mb": peak - base, "rss_mb": peak}


def soft_and_bam_figures(soft: dict[str, float], bam: dict[str, float]) -> dict[str, float]:
    """What a soft-vs-BAM benchmark prints of two measurements (``ms``, ``peak_mb``, ``rss_mb``):
    each one's step time and peak memory, BAM's ratios to soft, and the resident peaks."""
    return {
        "soft_ms": round(soft["ms"], 1), "bam_ms": round(bam["ms"], 1),
        "time_ratio": round(bam["ms"] / soft["ms"], 3),
        "soft_peak_mb": round(soft["peak_mb"], 1), "bam_peak_mb": round(bam["peak_mb"], 1),
        "mem_ratio": round(bam["peak_mb"] / soft["peak_mb"], 3),
        "soft_rss_mb": round(soft["rss_mb"], 1), "bam_rss_mb": round(bam["rss_mb"], 1),
    }


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device`` (cpu, cuda, cuda:N): where a benchmark builds its models and data."""
    parser.add_argument("--device", default="cpu", help="torch device of the models and data (cpu, cuda, cuda:1, ...)")


def to_device(value: Any, device: str) -> Any:
    """``value`` with every tensor in it (through tuples, lists and dicts) moved to ``device``."""
    if hasattr(value, "to") and hasattr(value, "device"):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def synchronized(device: str, function: Callable[[], Any]) -> Callable[[], Any]:
    """``function``, waiting for the device's queued kernels before it returns (a CUDA step's time
    is otherwise only its launch)."""
    if not device.startswith("cuda"):
        return function
    import torch

    def call() -> Any:
        result = function()
        torch.cuda.synchronize(device)
        return result

    return call


def step_peak_mb(step: Callable[[], Any], device: str) -> float:
    """Peak memory (MB) of one call of ``step`` above the memory before it: the kernel's resident
    high-water mark on the CPU, the caching allocator's peak of allocated memory on a GPU."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    before = resident_mb()
    reset_peak()
    step()
    return max(resident_mb("VmHWM") - before, 0.0)


def add_profile_option(parser: argparse.ArgumentParser) -> None:
    """``--profile STEPS``: after the timed steps, profile STEPS more of each model (CPU only)."""
    parser.add_argument("--profile", type=whole_number(0), default=0, metavar="STEPS",
                        help="after timing, profile STEPS more steps of each model with torch.profiler and print the "
                             "operators' self CPU time per step (the record keeps it; CPU only; default 0: no profile)")


def check_profile_option(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One line and status 2 for a ``--profile`` on a device the profile does not time."""
    if args.profile and not args.device.startswith("cpu"):
        parser.exit(2, f"{parser.prog}: error: --profile times CPU operators; not with --device {args.device}\n")


def operator_profile(step_of: dict[str, Callable[[], Any]], steps: int, compare: tuple[str, str], top: int = 15) -> dict[str, Any]:
    """Where each model's step spends its time: ``steps`` more steps of each (in turn) under
    ``torch.profiler``, every operator's self CPU time per step (ms), and each step's total.

    ``operators`` lists the union of every model's ``top`` operators and of the ``top`` operators
    in which the second model of ``compare = (baseline, bam)`` spends most more than the first, with
    their time in every model, ordered by that extra: the top of the list is where BAM's extra time
    goes; a last entry, ``(other operators)``, holds the rest of each model's time.
    The profiler adds a fixed cost per operator call, so many small operators (Pyro's bookkeeping)
    weigh a little more than in an unprofiled step; the steps' totals are the profiled ones."""
    from torch.profiler import ProfilerActivity, profile

    per_model: dict[str, dict[str, float]] = {}
    for name, step in step_of.items():
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(steps):
                step()
        per_model[name] = {e.key: e.self_cpu_time_total / 1000 / steps for e in profiler.key_averages()}
    baseline, bam = compare
    every = {op for times in per_model.values() for op in times}
    gap = {op: per_model[bam].get(op, 0.0) - per_model[baseline].get(op, 0.0) for op in every}
    shown = {op for times in per_model.values() for op in sorted(times, key=times.get, reverse=True)[:top]}
    shown |= set(sorted(every, key=lambda op: (-gap[op], op))[:top])
    rows = [{"operator": op, **{name: round(times.get(op, 0.0), 3) for name, times in per_model.items()}}
            for op in sorted(shown, key=lambda op: (-gap[op], op))]
    rest = {name: round(sum(t for op, t in times.items() if op not in shown), 3) for name, times in per_model.items()}
    return {
        "steps": steps, "compare": list(compare),
        "self_ms": {name: round(sum(times.values()), 2) for name, times in per_model.items()},
        "operators": [*rows, {"operator": OTHER_OPERATORS, **rest}],
    }
