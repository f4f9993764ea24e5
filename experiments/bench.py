"""Benchmarks that print their figures as one JSON line.

    python -m experiments.bench gat [--nodes N --edges E]   training step: PyG GATConv vs soft vs BAM-WC
    python -m experiments.bench gat-minibatch [--nodes N --edges E]   BAM-WC step: neighbour-sampled mini-batches vs full-batch
    python -m experiments.bench predictive                  posterior samples of a trained BAM-WC GAT
    python -m experiments.bench bert                        finetuning step: soft vs BAM-WC MiniLM
    python -m experiments.bench nmt                         translation training step: soft vs BAM-WC LSTM
    python -m experiments.bench vqa                         easy-VQA MCAN training step: soft vs BAM-WC
    python -m experiments.bench captioning                  Att2in captioning training step: soft vs BAM-WC

Ratios compare against a baseline measured in the same run, on this machine.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "gat": "experiments.gat.benchmark",
    "gat-minibatch": "experiments.gat.benchmark_minibatch",
    "predictive": "experiments.gat.benchmark_predictive",
    "bert": "experiments.glue.benchmark",
    "nmt": "experiments.nmt.benchmark",
    "vqa": "experiments.vqa.benchmark",
    "captioning": "experiments.captioning.benchmark",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m experiments.bench {{{','.join(BENCHMARKS)}}} [options]")
    importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
