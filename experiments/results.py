"""The committed results, and the docs tables and figures drawn from them.

    python -m experiments.results gat                  # results/gat, results/graph -> docs/results
    python -m experiments.results gat --add gat=runs/gat --add graph=runs/graph   # take new runs first
    python -m experiments.results gat --add graph-shift=runs/graph-shift           # runs with shift.npz (experiments.gat.ood)
    python -m experiments.results captioning --add captioning=runs/captioning      # Table 3 layout
    python -m experiments.results bench                # results/bench -> docs/results/bench_<bench>.md

``results/<source>/runs/<run>/`` holds the record of every run behind a table in the docs: the
runner's ``record.json`` (settings, metrics and the per-epoch history), beside the small files a
figure reads (``*.npz``). Checkpoints and other artifacts
stay in the run folders. A task declares what it publishes in its folder's ``published.py``
(:mod:`experiments.runner.publishing`): each table or figure and the folder of ``results/`` it is
drawn from; :data:`PUBLISHED` gathers them. The tables are the runner's own
(:func:`experiments.runner.task_tables`, the ``table.md`` a sweep prints), rows in the task's order
of panels and variants, so the same records give byte-identical Markdown; ``tests/test_results.py``
checks that the committed ``docs/results`` are what the committed records give. Every output is
drawn into a scratch folder first and replaces the docs' only once all of them are: a damaged
record or ``.npz`` (one line naming it, status 2) leaves the docs as they were. The benchmarks' records (``results/bench``, written by
``python -m experiments.bench ... --record NAME``) give one table per bench (:mod:`experiments.bench_records`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import pandas as pd

from bam_pyro.training import WriteFailed
from experiments import catalog
from experiments.bench_records import build_bench_tables
from experiments.records import RunFolder, flatten, read_folders
from experiments.runner import Task, require_agreement, task_tables
from experiments.runner.publishing import Figure, Table

RECORDS = Path("results")
DOCS = Path("docs/results")
#: what ``python -m experiments.results`` calls the benchmarks' records and tables
BENCH = "bench"

#: per task, what it publishes to the docs (its folder's ``published.py``)
PUBLISHED: dict[str, tuple[Union[Table, Figure], ...]] = {
    folder.name: catalog.published(folder.name) for folder in catalog.task_folders() if folder.publishes}


def in_task_order(table: pd.DataFrame, task: Task) -> pd.DataFrame:
    """Rows ordered by the task's panels, then its variants (a stable sort: ties keep their order)."""
    for column, order in (("variant", task.variants), (task.panel, task.panels)):
        if column in table:
            rank = {value: i for i, value in enumerate(order)}
            table = table.sort_values(column, key=lambda values: values.map(lambda v: rank.get(v, len(rank))),
                                      kind="stable")
    return table.reset_index(drop=True)


def load_results(task: Task, folder: Path) -> pd.DataFrame:
    """One row per run in ``folder`` (``runs/*/record.json``), in the task's order, seeds ascending.
    Raises ``ValueError`` if the runs mix settings (:func:`~experiments.runner.require_agreement`)."""
    records = read_folders([folder])
    if {r["task"] for r in records} != {task.name}:
        raise ValueError(f"{folder} holds runs of tasks {sorted({r['task'] for r in records})}, not only {task.name!r}")
    require_agreement(records, task, f"{folder} should hold one experiment's runs")
    results = pd.DataFrame([flatten(r) for r in records]).sort_values("seed", kind="stable")
    return in_task_order(results, task)


def table_markdown(task: Task, spec: Table, results: pd.DataFrame, folder: Optional[RunFolder] = None) -> str:
    """The Markdown of one published table, with a comment naming its command and records
    (``folder``: the records' folder, which a table of the runs' saved files reads)."""
    tables = spec.tables(results, folder) if spec.tables else task_tables(task, results)
    if spec.name not in tables:
        raise ValueError(f"task {task.name!r} makes no table {spec.name!r} of results/{spec.source} (it makes {sorted(tables)})")
    table = in_task_order(tables[spec.name], task)
    if spec.columns is not None:
        table = table[list(spec.columns)]
    note = f"<!-- python -m experiments.results {task.name}: table {spec.name!r} of results/{spec.source}; do not edit -->"
    return f"{note}\n\n{table.to_markdown(index=False, disable_numparse=True)}\n"


def build(name: str, records: Path = RECORDS, out: Path = DOCS) -> list[Path]:
    """Write every table and figure task ``name`` publishes from the records under ``records``
    into ``out`` (``bench``: every bench's table); returns the files written."""
    if name == BENCH:
        return build_bench_tables(records / BENCH, out)
    if name not in PUBLISHED:
        raise ValueError(f"task {name!r} publishes no results; known: {sorted(PUBLISHED)}")
    task = catalog.load_task(name)
    out.mkdir(parents=True, exist_ok=True)
    results = {source: load_results(task, records / source) for source in sorted({s.source for s in PUBLISHED[name]})}
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=out))  # every output drawn before any replaces the docs'
    try:
        drawn = []
        for spec in PUBLISHED[name]:
            if isinstance(spec, Table):
                path = staging / spec.file
                path.write_text(table_markdown(task, spec, results[spec.source], RunFolder(records / spec.source)))
                drawn.append(path)
            else:
                drawn += spec.draw(task, results[spec.source], RunFolder(records / spec.source), staging / spec.file)
        for path in drawn:
            os.replace(path, out / path.name)
    except OSError as error:
        raise WriteFailed(out, error) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / path.name for path in drawn]


def add_runs(name: str, folder: Path, destination: Path) -> list[str]:
    """Copy the finished runs of output folder ``folder`` into ``destination`` (a run already there
    is replaced): each record, and the run's ``*.npz`` files.
    Returns the runs' names."""
    found = RunFolder(folder).records()
    if not found:
        raise FileNotFoundError(f"no finished runs in {folder} (no runs/*/record.json)")
    other = sorted({r["task"] for r in found} - {name})
    if other:
        raise ValueError(f"{folder} holds runs of tasks {other}, not {name!r}")
    target, runs = RunFolder(destination), []
    for record in found:
        runs.append(record.pop("run"))
        del record["file"]
        target.save(runs[-1], record)
        for artifact in sorted(RunFolder(folder).run_dir(runs[-1]).glob("*.npz")):
            shutil.copyfile(artifact, target.run_dir(runs[-1]) / artifact.name)
    return runs


def source_folder(text: str) -> tuple[str, Path]:
    """``SOURCE=FOLDER`` of ``--add``."""
    source, sep, folder = text.partition("=")
    if not sep or not source or not folder:
        raise argparse.ArgumentTypeError(f"expected SOURCE=FOLDER, got {text!r}")
    return source, Path(folder)


def main(argv: Optional[Sequence[str]] = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m experiments.results", description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted([*PUBLISHED, BENCH]))
    parser.add_argument("--records", type=Path, default=RECORDS, help="the committed records (default: results)")
    parser.add_argument("--out", type=Path, default=DOCS, help="where the tables and figures go (default: docs/results)")
    parser.add_argument("--add", type=source_folder, action="append", default=[], metavar="SOURCE=FOLDER",
                        help="first copy the finished runs of output folder FOLDER into <records>/SOURCE")
    args = parser.parse_args(argv)
    sources = sorted({spec.source for spec in PUBLISHED.get(args.task, ())})
    try:
        for source, folder in args.add:
            if source not in sources:
                raise ValueError(f"task {args.task} publishes from {sources}, not {source!r}")
            runs = add_runs(args.task, folder, args.records / source)
            print(f"{args.records / source}: {len(runs)} runs from {folder}")
        written = build(args.task, args.records, args.out)
    except (ValueError, OSError) as error:  # FileNotFoundError and WriteFailed among the latter
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
