"""What the benchmarks share: running a measurement in a fresh process, and reading its memory.

CPU torch keeps no allocator statistics, so memory is read from the kernel (Linux ``/proc``). A
fresh process per measurement makes a process's peak its own; with ``RETURN_FREED_BLOCKS`` glibc
hands every block of 64 KiB or more straight back to the OS, so that resident memory follows live
tensors rather than the allocator's cache (it slows allocation, so times are taken without it).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

RETURN_FREED_BLOCKS = {"MALLOC_MMAP_THRESHOLD_": "65536"}


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


def resident_mb(field: str = "VmRSS") -> float:
    """This process's resident memory in MB: ``VmRSS`` (now) or ``VmHWM`` (the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> None:
    """Lower the resident peak (``VmHWM``) to the resident memory now."""
    Path("/proc/self/clear_refs").write_text("5")
