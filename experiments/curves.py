"""The training curves of output folders: ``python -m experiments.curves FOLDER... --out DIR``
reads every run record in the folders (``runs/*/record.json``) and writes
:func:`analysis.curves.curves_report` (``curves.csv``, ``summary.md``, ``curves.png``) into DIR."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import pandas as pd

from analysis.curves import curves_report
from experiments.records import read_folders, require_writable_folder


def main(argv: Optional[list[str]] = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m experiments.curves", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="output folders of task scripts (each with runs/*/record.json)")
    parser.add_argument("--out", type=Path, required=True, help="folder for curves.csv, summary.md, curves.png")
    parser.add_argument("--overlay", action="store_true", help="all run groups on one axis per metric, a colour each")
    args = parser.parse_args(argv)
    try:
        require_writable_folder(args.out)
        runs = [r for r in read_folders(args.folders) if r.get("training")]
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    for record in runs:
        record["run"] = f"{record['folder']}/{record['run']}" if len(args.folders) > 1 else record["run"]
    return curves_report(runs, args.out, overlay=args.overlay)


if __name__ == "__main__":
    main()
