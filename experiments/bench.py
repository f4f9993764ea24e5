"""Benchmarks that print their figures as one JSON line.

    python -m experiments.bench gat [--nodes N --edges E]   training step: PyG GATConv vs soft vs BAM-WC
    python -m experiments.bench gat-minibatch [--nodes N --edges E]   BAM-WC step: neighbour-sampled mini-batches vs full-batch
    python -m experiments.bench predictive                  posterior samples of a trained BAM-WC GAT
    python -m experiments.bench bert                        finetuning step: soft vs BAM-WC MiniLM
    python -m experiments.bench nmt                         translation training step: soft vs BAM-WC LSTM
    python -m experiments.bench vqa                         easy-VQA MCAN training step: soft vs BAM-WC
    python -m experiments.bench captioning                  Att2in captioning training step: soft vs BAM-WC

Ratios compare against a baseline measured in the same run, on this machine. Every bench also
takes ``--record NAME``: the figures are then written with the command line, the machine, the
thread count and the package versions to ``results/bench/<bench>/NAME.json``
(:mod:`experiments.bench_records`; ``--records DIR`` for another folder than ``results/bench``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from experiments.bench_records import BENCH_RECORDS, new_bench_record, record_name, write_bench_record

BENCHMARKS = {
    "gat": "experiments.gat.benchmark",
    "gat-minibatch": "experiments.gat.benchmark_minibatch",
    "predictive": "experiments.gat.benchmark_predictive",
    "bert": "experiments.glue.benchmark",
    "nmt": "experiments.nmt.benchmark",
    "vqa": "experiments.vqa.benchmark",
    "captioning": "experiments.captioning.benchmark",
}


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
    if not argv or argv[0] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m experiments.bench {{{','.join(BENCHMARKS)}}} [options]")
    bench, rest = argv[0], argv[1:]
    recording = recording_parser()
    if "-h" in rest or "--help" in rest:
        recording.print_help()
        print()
    options, bench_argv = recording.parse_known_args(rest)
    load_before = os.getloadavg()
    printed = importlib.import_module(BENCHMARKS[bench]).main(bench_argv)
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
