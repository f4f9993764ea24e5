"""Merge the results of several run folders into one table and picture.

A sweep is often spread over several run folders (one per setting, machine or shard). This gathers
them: ``python -m experiments.collect glue runs/glue-rte runs/glue-mrpc --out
runs/glue-all`` writes ``results.csv``, ``table.md`` (mean ± std per variant and the paired difference
to soft) and ``paired.png`` (every seed's runs joined by a line). For a run present in several
folders the later folder's row wins; runs of one task and variant that differ in a setting, or
variants of one task trained differently (other than in their attention's settings), are an
error, not a mean or a paired difference (a file with no column for a setting, from before it
was recorded, is merged with a warning that names it). ``--compare`` is for a sweep over settings instead: each distinct setting of a
task and variant is a row of its own (the settings that vary shown as columns: a blank cell as
"None", a folder whose file has no column for the setting as "(not recorded)"), and no picture is
drawn.
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import pandas as pd

from analysis.plots import paired_runs
from analysis.tables import summarize
from experiments import gat, glue
from experiments.glue_data import TASKS
from experiments.runs import VARIANT_SETTINGS, same_setting


log = logging.getLogger(__name__)

#: temporary column: the folder a row was read from
FOLDER = "_folder"
#: a --compare table's value of a setting whose folder's file has no column for it
NOT_RECORDED = "(not recorded)"


class Kind(NamedTuple):
    panel: str  # the column that names a task or data set
    table: Callable[[pd.DataFrame], pd.DataFrame]
    metric: Callable[[pd.DataFrame, str], str]  # the column plotted for one panel (its runs, its name)
    settings: tuple[str, ...]  # the columns a run's settings fill (its script's RunSettings.row())
    compared: Callable[[pd.DataFrame, str], list[str]]  # the columns a --compare table shows


KINDS = {
    "gat": Kind("dataset", gat.accuracy_table, lambda runs, dataset: "test_acc",
                tuple(gat.settings_for("cora", "wc", 0, {}).row()), lambda runs, dataset: ["val_acc", "test_acc"]),
    "glue": Kind("task", glue.side_by_side, lambda runs, task: f"{glue.score_prefix(runs)}_{TASKS[task].metrics[0]}",
                 tuple(glue.settings_for("rte", "wc", 0, "model", {}).row()),
                 lambda runs, task: [f"{glue.score_prefix(runs)}_{m}" for m in TASKS[task].metrics]),
}


def setting_columns(results: pd.DataFrame, kind: Kind) -> list[str]:
    """The settings recorded in ``results`` other than the run's keys (task, variant, seed)."""
    return [c for c in kind.settings if c in results and c not in (kind.panel, "variant", "seed")]


def settings_disagreement(
    runs: pd.DataFrame, settings: list[str], columns: dict[str, set[str]]
) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """For the runs of one task and variant (``columns``: each folder's file's columns): the
    settings whose recorded values differ, and the (folder, setting) pairs taken as agreeing
    because that folder's file has no column for the setting."""
    mixed, assumed = {}, []
    for name in settings:
        recorded = runs[FOLDER].map(lambda folder: name in columns[folder])
        values = runs.loc[recorded, name]
        if any(not same_setting(value, values.iloc[0]) for value in values):
            mixed[name] = sorted(set(map(str, values)))
        elif recorded.any():
            assumed += [(folder, name) for folder in runs.loc[~recorded, FOLDER].unique()]
    return mixed, assumed


def require_agreement(
    results: pd.DataFrame, by: list[str], settings: list[str], columns: dict[str, set[str]], reason: str
) -> list[tuple[str, str]]:
    """Raise, naming the settings and ``reason``, if the runs of a group of ``by`` differ in
    ``settings``; returns the (folder, setting) pairs taken as agreeing (see
    :func:`settings_disagreement`)."""
    assumed = []
    for key, runs in results.groupby(by, sort=False):
        mixed, assumptions = settings_disagreement(runs, settings, columns)
        if mixed:
            raise ValueError(f"the {'/'.join(map(str, key))} runs differ in their settings {mixed}: {reason}")
        assumed += assumptions
    return assumed


def read_results(folders: list[Path], kind: Kind, compare: bool = False) -> pd.DataFrame:
    """The folders' rows, one per (task, variant, seed) or, with ``compare``, per (task, variant,
    seed, settings). Without ``compare`` rows of one task and variant must share their settings
    (a blank cell reads as None and must agree like any value; in a file that gained the column
    later it may also be an older row, which is then refused rather than guessed), and the
    variants of one task their training protocol (all but ``VARIANT_SETTINGS``), since the table
    pairs them by seed. A folder whose file has no column for a setting (written
    before it was recorded) is merged as if it had the others' value, with a warning that names
    the folder and the settings so assumed."""
    frames = {}
    for folder in map(str, folders):
        path = Path(folder) / "results.csv"
        if not path.is_file():
            raise FileNotFoundError(f"no results.csv in {folder}: not a run folder (or no run finished there yet)")
        frames[folder] = pd.read_csv(path).assign(**{FOLDER: folder})
    results = pd.concat(frames.values(), ignore_index=True)
    settings = setting_columns(results, kind)
    if compare:
        for folder, frame in frames.items():
            missing = [c for c in settings if c not in frame]
            results = results.astype({c: object for c in missing})
            results.loc[results[FOLDER] == folder, missing] = NOT_RECORDED
        return results.drop_duplicates([kind.panel, "variant", "seed", *settings], keep="last").drop(columns=FOLDER)
    results = results.drop_duplicates([kind.panel, "variant", "seed"], keep="last")
    columns = {folder: set(frame.columns) for folder, frame in frames.items()}
    protocol = [c for c in settings if c not in VARIANT_SETTINGS]
    assumed = defaultdict(set)
    for folder, setting in [
        *require_agreement(results, [kind.panel, "variant"], settings, columns, "they are not seeds of one experiment"),
        *require_agreement(results, [kind.panel], protocol, columns,
                           "variants are paired by seed only if trained alike (only their attention's settings may differ)"),
    ]:
        assumed[folder].add(setting)
    for folder, names in assumed.items():
        log.warning("%s does not record %s (its file predates them): its runs are merged as if they "
                    "had the other folders' values", folder, ", ".join(sorted(names)))
    return results.drop(columns=FOLDER)


def compare_table(results: pd.DataFrame, kind: Kind) -> pd.DataFrame:
    """Mean ± std over seeds per task, variant and distinct setting, one row each; the settings that
    vary within a task and variant are columns after the variant."""
    settings = setting_columns(results, kind)
    per_run = results.groupby([kind.panel, "variant"], sort=False)
    varying = [c for c in settings if per_run[c].nunique(dropna=False).gt(1).any()]
    shown = results.astype({c: object for c in varying})
    shown[varying] = shown[varying].where(shown[varying].notna(), "None")
    tables = [summarize(runs, [kind.panel, "variant", *varying], kind.compared(runs, name))
              for name, runs in shown.groupby(kind.panel, sort=False)]
    return pd.concat(tables).fillna("").reset_index()


def main(argv: Optional[list[str]] = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--compare", action="store_true", help="one row per distinct setting instead of refusing mixed settings")
    args = p.parse_args(argv)
    kind = KINDS[args.kind]
    results = read_results(args.folders, kind, args.compare)
    args.out.mkdir(parents=True, exist_ok=True)
    results.to_csv(args.out / "results.csv", index=False)
    table = compare_table(results, kind) if args.compare else kind.table(results)
    text = table.to_markdown(index=not args.compare)
    (args.out / "table.md").write_text(text + "\n")
    if not args.compare:
        metrics = {name: kind.metric(runs, name) for name, runs in results.groupby(kind.panel, sort=False)}
        paired_runs(results, kind.panel, metrics, args.out / "paired.png")
    print(text)
    return table


if __name__ == "__main__":
    main()
