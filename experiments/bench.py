"""Benchmarks that print their figures as one JSON line: ``python -m experiments.bench NAME [options]``.

The benchmarks are those the task folders declare (:mod:`experiments.catalog`); the command without
a name lists them, and ``python -m experiments.bench NAME --help`` gives a benchmark's options.
Ratios compare against a baseline measured in the same run, on this machine.
"""

from __future__ import annotations

import sys

from experiments import catalog


def usage(benchmarks: dict[str, tuple[catalog.TaskFolder, catalog.Benchmark]]) -> str:
    width = max(map(len, benchmarks))
    listed = "".join(f"\n  {name:<{width}}  {benchmark.description}" for name, (_, benchmark) in benchmarks.items())
    return f"usage: python -m experiments.bench {{{','.join(benchmarks)}}} [options]{listed}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    benchmarks = catalog.benchmarks()
    if not argv or argv[0] not in benchmarks:
        raise SystemExit(usage(benchmarks))
    catalog.benchmark_main(argv[0])(argv[1:])


if __name__ == "__main__":
    main()
