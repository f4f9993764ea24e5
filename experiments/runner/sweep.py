"""The sweep: every run of panels x variants x seeds planned (finished ones left out, conflicting
ones refused), each trained by the process that claims it, its record saved, then the tables."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import pandas as pd

from bam_pyro.distributed import Engine, LocalEngine
from experiments.records import CHECKPOINT, RunFolder, new_record
from experiments.runner.tables import write_tables
from experiments.runner.task import VARIANT_SETTINGS, RunContext, RunSettings, Task


def require_agreement(results: pd.DataFrame, task: Task, settings: Sequence[str], advice: str) -> None:
    """Runs of a panel and variant share every setting but the seed, and the variants of a panel
    all but their attention's (:data:`VARIANT_SETTINGS`): else their table would pool or pair runs
    of different experiments. Raises ``ValueError`` naming the settings, and ``advice``."""
    protocol = [s for s in settings if s not in VARIANT_SETTINGS]
    for by, names, reason in (([task.panel, "variant"], settings, "they are not seeds of one experiment"),
                              ([task.panel], protocol, "variants are paired by seed only if trained alike")):
        for key, runs in results.groupby(by, sort=False):
            mixed = {n: sorted(map(str, runs[n].unique())) for n in names if runs[n].astype(str).nunique() > 1}
            if mixed:
                raise ValueError(f"the {'/'.join(map(str, key if isinstance(key, tuple) else (key,)))} runs "
                                 f"differ in {mixed}: {reason} ({advice})")


def plan_sweep(task: Task, panels: Sequence[str], variants: Sequence[str], seeds: Sequence[int],
               overrides: Mapping[str, Any], folder: RunFolder) -> dict[str, list[RunSettings]]:
    """Every run's settings, per panel, with those already finished left out. A finished run of
    the same name with other settings raises :class:`~experiments.records.SettingsMismatch`, and
    an unfinished one whose checkpoint holds other settings ``ValueError``; a damaged record or
    checkpoint raises ``DamagedFile``; a run that would not agree with the folder's finished runs
    (:func:`require_agreement`: another seed of the same variant trained otherwise) raises
    ``ValueError``."""
    plan, asked = {}, []
    for panel in panels:
        runs = [task.settings_for(panel, v, s, overrides) for s in seeds for v in variants]  # paired by seed
        plan[panel] = [r for r in runs if not folder.finished(task.run_name(r), task.name, r.row())]
        for settings in plan[panel]:
            folder.require_resumable(task.run_name(settings), settings.row())
        asked += [r.row() for r in plan[panel]]
    if asked:
        finished = [r["settings"] for r in folder.records() if r["task"] == task.name]
        rows = pd.DataFrame(finished + asked, dtype=object)
        settings = [name for name in asked[0] if name != "seed"]
        require_agreement(rows, task, settings, f"{folder.out} holds runs of other settings: choose another --out")
    return plan


def run_sweep(task: Task, plan: Mapping[str, list[RunSettings]], folder: RunFolder, args: argparse.Namespace,
              parser: argparse.ArgumentParser, engine: Optional[Engine] = None) -> dict[str, pd.DataFrame]:
    """Train the planned runs (each by the processes of ``engine`` together) and write the tables;
    processes other than process 0 return no tables."""
    engine = engine or LocalEngine()
    for panel, runs in plan.items():
        if not runs:
            continue
        try:
            data = task.load(runs[0], args.data_root)
        except (ValueError, FileNotFoundError) as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        for settings in runs:
            name = task.run_name(settings)
            with claimed_by_process_zero(folder, name, engine) as ours:
                if not ours:
                    print(f"{name}: being trained by another process in {folder.out}, left to it", flush=True)
                    continue
                if engine.broadcast(engine.is_global_zero and folder.finished(name, task.name, settings.row())):
                    continue  # by another process since the plan
                record = train_one(task, settings, data, folder, args, engine)
            if not engine.is_global_zero:
                continue
            shown = ", ".join(f"{m} {record['metrics'][m]:.4g}" for m in task.metrics_of(panel) if m in record["metrics"])
            print(f"{panel} {settings.variant} seed {settings.seed}: {shown} ({record['wall_seconds']:.0f}s)", flush=True)
    if not engine.is_global_zero:
        return {}
    results = folder.write_results()
    asked = results[results[task.panel].isin(args.panels) & results["variant"].isin(args.variant)]
    return write_tables(task, asked, folder.out)


@contextlib.contextmanager
def claimed_by_process_zero(folder: RunFolder, name: str, engine: Engine) -> Iterator[bool]:
    """:meth:`RunFolder.claimed` by process 0, its answer on every process."""
    if not engine.is_global_zero:
        yield engine.broadcast(None)
        return
    with folder.claimed(name) as ours:
        yield engine.broadcast(ours)


def train_one(task: Task, settings: RunSettings, data: Any, folder: RunFolder, args: argparse.Namespace,
              engine: Optional[Engine] = None) -> dict:
    """Train one run (on every process of ``engine``) and save its record (process 0)."""
    engine = engine or LocalEngine()
    name = task.run_name(settings)
    with contextlib.ExitStack() as scratch:
        artifacts = folder.run_dir(name) if engine.is_global_zero else Path(
            scratch.enter_context(tempfile.TemporaryDirectory(prefix=f"{name}-process{engine.rank}-")))
        context = RunContext(artifacts, settings, progress=not args.no_progress, checkpoint_seconds=60 * args.checkpoint_minutes,
                             description=name, engine=engine, checkpoint=folder.run_dir(name) / CHECKPOINT)
        start = time.perf_counter()
        metrics = task.train(settings, data, context)
    metrics = {**metrics, **engine.mean({k: v for k, v in metrics.items() if isinstance(v, float)})}
    fit = context.fit_result
    training = None if fit is None else {
        "epochs": fit.epochs, "best_epoch": fit.best_epoch, "stopped_early": fit.stopped_early,
        "seconds": round(fit.seconds, 1), "monitors": fit.monitors, "history": fit.history}
    record = new_record(task.name, settings.row(), metrics, training, time.perf_counter() - start, engine.describe())
    if engine.is_global_zero:
        folder.save(name, record)
    return record
