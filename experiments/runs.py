"""What every task script shares: its common command-line options and a results file that
makes a sweep resumable (finished runs are skipped, each new row is saved at once)."""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import pandas as pd

from bam_pyro.config import GAMMA_SHAPES, PRIOR_SCOPES, VARIANTS, BamConfig

#: the hyperparameters of ``BamConfig`` (all but the variant): overridable and recorded in every row
BAM_FIELDS = tuple(f.name for f in dataclasses.fields(BamConfig) if f.name != "variant")
#: the settings of a variant's attention: ``BamConfig``'s and the KL's weight and annealing rate.
#: Presets set them per variant; every other setting of a run (optimizer, loss, training length,
#: data) is its training protocol, which variants compared with each other must share
VARIANT_SETTINGS = (*BAM_FIELDS, "att_kl", "rho")


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``minimum`` (the error names the option)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def add_run_arguments(parser: argparse.ArgumentParser, default_out: str, data_help: str) -> None:
    """--variant --seeds --data-root --out --threads --no-progress."""
    parser.add_argument("--variant", nargs="+", default=["soft", "wc"], choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=whole_number(0), default=[0])
    parser.add_argument("--data-root", default=None, help=data_help)
    parser.add_argument("--out", default=default_out, help="output folder: results.csv, table.md, checkpoints/")
    parser.add_argument("--threads", type=whole_number(1), default=min(2, os.cpu_count() or 1), help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")


def add_contextual_prior_arguments(group: argparse._ArgumentGroup) -> None:
    """--gamma-shape and --prior-scope: the form of the contextual prior (``BamConfig``)."""
    group.add_argument("--gamma-shape", choices=GAMMA_SHAPES, default=None,
                       help="contextual Gamma shape: Psi * beta (reference code) or Psi (paper's text)")
    group.add_argument("--prior-scope", choices=PRIOR_SCOPES, default=None,
                       help="Psi is a softmax over each query's keys or over all keys (paper, reference code)")


def require_at_least(minimum: float, **values: object) -> None:
    """Each given setting (None: not set) is a finite number >= ``minimum``; the error names it."""
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
            raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")


def given_overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, object]:
    """The command line's values of the overridable settings ``names`` (None: keep the preset)."""
    return {name: getattr(args, name) for name in names}


def same_setting(recorded: object, asked: object) -> bool:
    """Equality of a setting read back from the CSV and one asked for (NaN is None, floats to 1e-9)."""
    if asked is None or (isinstance(asked, float) and math.isnan(asked)):
        return pd.isna(recorded)
    if pd.isna(recorded):
        return False
    if isinstance(asked, (bool, str)):
        return str(recorded) == str(asked)
    return math.isclose(float(recorded), float(asked), rel_tol=1e-9, abs_tol=0.0)


def setting_differences(recorded: Mapping[str, object], asked: Mapping[str, object]) -> list[str]:
    """``name=recorded (asked for value)`` for every setting a finished run's record does not
    match. A setting the record lacks (written before it existed) may have had another value, so
    it counts as different: ``name=not recorded``. A blank CSV cell reads as None, which in a file
    that gained the column later may also be such an older row: it matches only None."""
    differing = []
    for name, value in asked.items():
        if name not in recorded:
            differing.append(f"{name}=not recorded (asked for {value})")
        elif not same_setting(recorded[name], value):
            differing.append(f"{name}={None if pd.isna(recorded[name]) else recorded[name]} (asked for {value})")
    return differing


def settings_digest(settings: Mapping[str, object]) -> str:
    """Ten hex digits that change with any setting: checkpoint names, so that a changed setting
    never resumes another run's state."""
    text = json.dumps(dict(settings), sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


class ResultsFile:
    """``<out>/results.csv``: one row per finished run, identified by ``keys``.

    A folder holds one setting per key (e.g. dataset, variant, seed): asking again for a finished
    run with other hyperparameters raises instead of silently returning the old result, and each
    run's checkpoint is named by a digest of all its settings, so a changed setting never resumes
    another run's state. The file is read again before every check and write, and replaced whole,
    so processes sharing a folder see each other's finished runs and keep each other's rows.
    """

    def __init__(self, out: Path, keys: tuple[str, ...]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.keys = out / "results.csv", keys
        self.frame = self._read()

    def _read(self) -> pd.DataFrame:
        return pd.read_csv(self.path) if self.path.exists() else pd.DataFrame()

    def has(self, settings: Mapping[str, object]) -> bool:
        """Whether the run described by ``settings`` (its result row's settings) is finished."""
        self.frame = self._read()
        if self.frame.empty:
            return False
        match = pd.Series(True, index=self.frame.index)
        for name in self.keys:
            match &= self.frame[name] == settings[name]
        if not match.any():
            return False
        differing = setting_differences(self.frame[match].iloc[-1], settings)
        if differing:
            run = ", ".join(f"{name}={settings[name]}" for name in self.keys)
            raise ValueError(f"{self.path} already holds the run {run} with other or unrecorded settings: "
                             f"{'; '.join(differing)}. Choose another --out for the new settings.")
        return True

    def checkpoint(self, settings: Mapping[str, object]) -> Path:
        """``<out>/checkpoints/<keys>-<digest of all settings>.pt``."""
        stem = "-".join(str(settings[name]) for name in self.keys)
        return self.path.parent / "checkpoints" / f"{stem}-{settings_digest(settings)}.pt"

    def add(self, row: dict) -> None:
        # the lock makes read-append-replace one step, so two writers cannot both append to the
        # same old file and drop one row; the replace is atomic, so a reader never sees half a file
        with open(self.path.with_name(f".{self.path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.frame = pd.concat([self._read(), pd.DataFrame([row])], ignore_index=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            self.frame.to_csv(partial, index=False)
            os.replace(partial, self.path)
