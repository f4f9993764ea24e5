"""Benchmarks that print their figures as one JSON line: ``python -m experiments.bench NAME [options]``.

The benchmarks are those the task folders declare (:mod:`experiments.catalog`); the command without
a name lists them, and ``python -m experiments.bench NAME --help`` gives a benchmark's options.
Ratios compare against a baseline measured in the same run, on this machine. Every bench also
takes ``--record NAME``: the figures are then written with the command line, the machine, the
thread count and the package versions to ``results/bench/<bench>/NAME.json``
(:mod:`experiments.bench_records`; ``--records DIR`` for another folder than ``results/bench``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments import catalog
from experiments.bench_records import BENCH_RECORDS, new_bench_record, record_name, write_bench_record
from experiments.records import require_writable_folder


def usage(benchmarks: dict[str, tuple[catalog.TaskFolder, catalog.Benchmark]]) -> str:
    width = max(map(len, benchmarks))
    listed = "".join(f"\n  {name:<{width}}  {benchmark.description}" for name, (_, benchmark) in benchmarks.items())
    return f"usage: python -m experiments.bench {{{','.join(benchmarks)}}} [options]{listed}"


def recording_parser() -> argparse.ArgumentParser:
    """The options every bench takes to record its figures (the bench's own options are its own)."""
    parser = argparse.ArgumentParser(prog="python -m experiments.bench NAME", add_help=False, allow_abbrev=False)
    group = parser.add_argument_group("recording (every bench)")

    def name(text: str) -> str:
        try:
            return record_name(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    group.add_argument("--record", type=name, metavar="NAME",
                       help="write the figures, command line, machine, threads and versions to <records>/<bench>/NAME.json")
    group.add_argument("--records", type=Path, default=BENCH_RECORDS, metavar="DIR",
                       help=f"the folder of bench records (default: {BENCH_RECORDS})")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    """Run bench ``argv[0]`` with the rest of ``argv``; returns the rows of figures it printed."""
    argv = sys.argv[1:] if argv is None else argv
    benchmarks = catalog.benchmarks()
    if not argv or argv[0] not in benchmarks:
        raise SystemExit(usage(benchmarks))
    bench, rest = argv[0], argv[1:]
    recording = recording_parser()
    if "-h" in rest or "--help" in rest:
        recording.print_help()
        print()
    options, bench_argv = recording.parse_known_args(rest)
    if options.record is not None:
        try:  # before the bench runs: a measurement of minutes is not to be lost at the end
            require_writable_folder(options.records / bench, "--records")
        except ValueError as error:
            recording.exit(2, f"python -m experiments.bench {bench}: error: {error}\n")
    load_before = os.getloadavg()
    printed = catalog.benchmark_main(bench)(bench_argv)
    rows = printed if isinstance(printed, list) else [printed]
    if options.record is not None:
        try:
            record = new_bench_record(bench, rest, bench_argv, rows, load_before)
        except ValueError as error:
            recording.exit(2, f"python -m experiments.bench {bench}: error: {error}\n")
        print(f"recorded: {write_bench_record(options.records, options.record, record)}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
