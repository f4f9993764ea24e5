"""Merge the runs of several output folders into one table and picture.

    python -m experiments.collect runs/glue-rte runs/glue-mrpc --out runs/glue-all
    python -m experiments.collect runs/gat runs/gat-k1 --compare --out runs/gat-k-compare

A sweep is often spread over folders (one per setting, machine or shard). This reads their run
records and writes ``results.csv``, the task's tables (``table.md``, ``table-<name>.csv``) and
``paired.png``, as the task script would for one folder. A run present in several folders with the
same settings is taken from the later one; with other settings it is refused, naming both folders
and the settings (which of the two the table showed would be a matter of the order of the folders),
unless ``--later-wins`` says that the later folder's runs are to replace the earlier ones (a variant
re-run with other settings, paired with the first folder's other variants).
Runs of one panel and variant that differ in a setting are not seeds of one
experiment, and variants of one panel trained differently (other than in their attention's
settings) cannot be paired by seed: both are refused, naming the settings. ``--compare`` is for a
sweep over settings instead: one row per distinct setting of a panel and variant, the settings
that vary as columns, no pairing.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from analysis.tables import summarize
from experiments import catalog
from experiments.records import flatten, read_folders, require_writable_folder, setting_differences
from experiments.runner import Task, require_agreement, write_tables


def merged(records: Sequence[dict], compare: bool) -> pd.DataFrame:
    """One row per run (later folders win); with ``compare``, one per run and distinct settings."""
    rows = pd.DataFrame([{**flatten(r), "_run": r["run"]} for r in records])
    settings = [c for c in records[0]["settings"] if c != "seed"]
    keys = ["task", "_run", *settings] if compare else ["task", "_run"]
    return rows.astype({c: object for c in settings}).drop_duplicates(keys, keep="last").drop(columns="_run")


def require_one_setting_per_run(records: Sequence[dict]) -> None:
    """Raise ``ValueError`` if two folders hold one run (task and name) with different settings,
    naming both folders and the settings."""
    first: dict[tuple[str, str], dict] = {}
    for record in records:
        seen = first.setdefault((record["task"], record["run"]), record)
        differing = setting_differences(seen["settings"], record["settings"], f"in {record['folder']}:")
        if differing:
            raise ValueError(f"run {record['run']} is in {seen['folder']} and {record['folder']} with other settings: "
                             f"{'; '.join(differing)} (--later-wins takes the later folder's, --compare tabulates both)")


def compare_table(results: pd.DataFrame, task: Task, settings: Sequence[str]) -> pd.DataFrame:
    """Mean ± std over seeds per panel, variant and distinct setting; varying settings as columns."""
    per_run = results.groupby([task.panel, "variant"], sort=False)
    varying = [s for s in settings if s not in (task.panel, "variant") and per_run[s].nunique(dropna=False).gt(1).any()]
    shown = results.astype({c: str for c in varying})
    tables = [summarize(runs, [task.panel, "variant", *varying], [m for m in task.metrics_of(panel) if m in runs])
              for panel, runs in shown.groupby(task.panel, sort=False)]
    return pd.concat(tables).fillna("").reset_index()


def main(argv: Optional[Sequence[str]] = None) -> dict[str, pd.DataFrame]:
    parser = argparse.ArgumentParser(prog="python -m experiments.collect", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="output folders of one task script")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", action="store_true", help="one row per distinct setting instead of refusing mixed settings")
    parser.add_argument("--later-wins", action="store_true",
                        help="a run held by several folders with other settings is taken from the later folder")
    args = parser.parse_args(argv)
    try:
        require_writable_folder(args.out)
        records = read_folders(args.folders)
        tasks = sorted({r["task"] for r in records})
        if len(tasks) > 1:
            raise ValueError(f"the folders hold runs of several tasks {tasks}; collect one task at a time")
        task = catalog.load_task(tasks[0])
        settings = [c for c in records[0]["settings"] if c != "seed"]
        results = merged(records, args.compare)
        if not (args.compare or args.later_wins):
            require_one_setting_per_run(records)
            require_agreement(results, task, settings, "use --compare to tabulate them side by side")
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    results.to_csv(args.out / "results.csv", index=False)
    if args.compare:
        table = compare_table(results, task, settings)
        (args.out / "table.md").write_text(table.to_markdown(index=False, disable_numparse=True) + "\n")
        print(table.to_markdown(index=False, disable_numparse=True))
        return {"compare": table}
    return write_tables(task, results, args.out)


if __name__ == "__main__":
    main()
