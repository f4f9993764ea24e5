"""What every task script shares: its common command-line options and a results file that
makes a sweep resumable (finished runs are skipped, each new row is saved at once)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pandas as pd

from bam_pyro.config import VARIANTS


def add_run_arguments(parser: argparse.ArgumentParser, default_out: str, data_help: str) -> None:
    """--variant --seeds --data-root --out --threads --no-progress."""
    parser.add_argument("--variant", nargs="+", default=["soft", "wc"], choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--data-root", default=None, help=data_help)
    parser.add_argument("--out", default=default_out, help="output folder: results.csv, table.md, checkpoints/")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")


class ResultsFile:
    """``<out>/results.csv``: one row per finished run, identified by ``keys``."""

    def __init__(self, out: Path, keys: tuple[str, ...]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.keys = out / "results.csv", keys
        self.frame = pd.read_csv(self.path) if self.path.exists() else pd.DataFrame()

    def has(self, **key: object) -> bool:
        if self.frame.empty:
            return False
        match = pd.Series(True, index=self.frame.index)
        for name in self.keys:
            match &= self.frame[name] == key[name]
        return bool(match.any())

    def add(self, row: dict) -> None:
        self.frame = pd.concat([self.frame, pd.DataFrame([row])], ignore_index=True)
        self.frame.to_csv(self.path, index=False)
