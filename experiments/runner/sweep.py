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
from bam_pyro.training import DamagedFile, Diverged, WriteFailed, same_setting
from experiments.records import CHECKPOINT, RunFolder, SettingsMismatch, new_record
from experiments.runner.tables import write_tables
from experiments.runner.task import VARIANT_SETTINGS, RunContext, RunSettings, Task


def require_agreement(runs: Sequence[Mapping[str, Any]], task: Task, advice: str) -> None:
    """Runs of a panel and variant share every setting but the seed, and the variants of a panel
    all but their attention's (:data:`VARIANT_SETTINGS`): else their table would pool or pair runs
    of different experiments. A setting one run has and another lacks is a difference too (the
    lacking one may have had any value). ``runs``: ``{"settings", "run", "file"}`` each (``file``:
    the record, or the lock of a run in progress; None for a run asked for). Raises
    :class:`SettingsMismatch` naming both runs, their files and the differing values, and ``advice``."""
    for by, compared, reason in (((task.panel, "variant"), lambda name: name != "seed", "they are not seeds of one experiment"),
                                 ((task.panel,), lambda name: name != "seed" and name not in VARIANT_SETTINGS,
                                  "variants are paired by seed only if trained alike")):
        first: dict[tuple, Mapping[str, Any]] = {}
        for run in runs:
            seen = first.setdefault(tuple(run["settings"].get(name) for name in by), run)
            names = [n for n in dict.fromkeys([*seen["settings"], *run["settings"]]) if compared(n)]
            differing = [f"{n}={_value(seen, n)} / {_value(run, n)}" for n in names
                         if n not in seen["settings"] or n not in run["settings"]
                         or not same_setting(seen["settings"][n], run["settings"][n])]
            if differing:
                group = "/".join(str(run["settings"].get(name)) for name in by)
                raise SettingsMismatch(f"the {group} runs {_where(seen)} and {_where(run)} differ in {'; '.join(differing)}: "
                                       f"{reason} ({advice})")


def _value(run: Mapping[str, Any], name: str) -> str:
    return repr(run["settings"][name]) if name in run["settings"] else "not recorded"


def _where(run: Mapping[str, Any]) -> str:
    return f"{run['run']} ({run['file'] if run.get('file') else 'asked for'})"


def folder_runs(task: Task, folder: RunFolder) -> list[dict[str, Any]]:
    """The runs of ``task`` in ``folder`` that a table of it would pool: the finished ones, and
    those other live processes are training."""
    return [r for r in folder.records() if r["task"] == task.name] + [
        r for r in folder.in_progress() if r["settings"].get(task.panel) is not None]


def plan_sweep(task: Task, panels: Sequence[str], variants: Sequence[str], seeds: Sequence[int],
               overrides: Mapping[str, Any], folder: RunFolder) -> dict[str, list[RunSettings]]:
    """Every run's settings, per panel, with those already finished left out. A finished run of
    the same name with other settings raises :class:`~experiments.records.SettingsMismatch`, and
    an unfinished one whose checkpoint holds other settings ``ValueError``; a damaged record or
    checkpoint raises ``DamagedFile``; a run that would not agree with the folder's finished runs
    or the runs other processes are training in it (:func:`require_agreement`: another seed of the
    same variant trained otherwise) raises ``SettingsMismatch``."""
    plan, asked = {}, []
    for panel in panels:
        runs = [task.settings_for(panel, v, s, overrides) for s in seeds for v in variants]  # paired by seed
        plan[panel] = [r for r in runs if not folder.finished(task.run_name(r), task.name, r.row())]
        for settings in plan[panel]:
            folder.require_resumable(task.run_name(settings), settings.row())
        asked += [{"run": task.run_name(r), "file": None, "settings": r.row()} for r in plan[panel]]
    if asked:
        require_agreement(folder_runs(task, folder) + asked, task, f"{folder.out} holds runs of other settings: choose another --out")
    return plan


def run_sweep(task: Task, plan: Mapping[str, list[RunSettings]], folder: RunFolder, args: argparse.Namespace,
              parser: argparse.ArgumentParser, engine: Optional[Engine] = None) -> dict[str, pd.DataFrame]:
    """Train the planned runs (each by the processes of ``engine`` together) and write the tables;
    processes other than process 0 return no tables. A run found finished meanwhile, or claimed
    while another process trains a run of other settings into the folder, ends the sweep with one
    line (status 2) before anything of it is trained or tabulated, as does a failed write. A run
    that diverges (:class:`~bam_pyro.training.Diverged`) is reported in one line and the sweep goes
    on; once the others are tabulated, the sweep ends with status 1 naming the runs that failed."""
    engine = engine or LocalEngine()
    try:
        left, failed = train_planned(task, plan, folder, args, parser, engine)
        if not engine.is_global_zero:
            return {}
        require_agreement(folder_runs(task, folder), task, f"{folder.out} holds runs of other settings")
        results = folder.write_results()
        asked = results[results[task.panel].isin(args.panels) & results["variant"].isin(args.variant)] if len(results) else results
        if asked.empty and left:
            print(f"{folder.out}: no finished run to tabulate yet: {', '.join(left)} "
                  f"{'is' if len(left) == 1 else 'are'} being trained by other processes (--wait waits for them)", flush=True)
        tables = {} if asked.empty else write_tables(task, asked, folder.out)
    except (SettingsMismatch, DamagedFile, WriteFailed) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if failed:
        parser.exit(1, f"{parser.prog}: error: {len(failed)} run(s) diverged and have no record: {', '.join(failed)} "
                       "(their last checkpoints are kept; see the lines above for where each stopped)\n")
    return tables


def train_planned(task: Task, plan: Mapping[str, list[RunSettings]], folder: RunFolder, args: argparse.Namespace,
                  parser: argparse.ArgumentParser, engine: Engine) -> tuple[list[str], list[str]]:
    """Train each planned run that no other process holds (with ``args.wait``, wait for those);
    returns the names of those left to others, and of those that diverged (each said in one line)."""
    left, failed = [], []
    for panel, runs in plan.items():
        if not runs:
            continue
        try:
            data = task.load(runs[0], args.data_root)
        except (ValueError, FileNotFoundError) as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        for settings in runs:
            name = task.run_name(settings)
            with claimed_by_process_zero(folder, name, settings.row(), getattr(args, "wait", False), engine) as ours:
                if not ours:
                    print(f"{name}: being trained by another process in {folder.out}, left to it", flush=True)
                    left.append(name)
                    continue
                if engine.broadcast(engine.is_global_zero and folder.finished(name, task.name, settings.row())):
                    continue  # by another process since the plan
                refusal = engine.broadcast(engine.is_global_zero and _refusal(task, folder, name, settings))
                if refusal:  # a process that started on this folder with other settings since the plan
                    parser.exit(2, f"{parser.prog}: error: {refusal}\n")
                try:
                    record = train_one(task, settings, data, folder, args, engine)
                except Diverged as error:
                    print(f"{name}: diverged, not recorded: {error}", flush=True)
                    failed.append(name)
                    continue
            if not engine.is_global_zero:
                continue
            shown = ", ".join(f"{m} {record['metrics'][m]:.4g}" for m in task.metrics_of(panel) if record["metrics"].get(m) is not None)
            print(f"{panel} {settings.variant} seed {settings.seed}: {shown} ({record['wall_seconds']:.0f}s)", flush=True)
    return left, failed


def _refusal(task: Task, folder: RunFolder, name: str, settings: RunSettings) -> Optional[str]:
    """Why run ``name`` may not join the folder's runs (:func:`require_agreement`), None if it may."""
    try:
        require_agreement(folder_runs(task, folder) + [{"run": name, "file": None, "settings": settings.row()}],
                          task, f"{folder.out} holds runs of other settings: choose another --out")
    except SettingsMismatch as error:
        return str(error)
    return None


@contextlib.contextmanager
def claimed_by_process_zero(folder: RunFolder, name: str, settings: Mapping[str, Any], wait: bool,
                            engine: Engine) -> Iterator[bool]:
    """:meth:`RunFolder.claimed` by process 0, its answer on every process."""
    if not engine.is_global_zero:
        yield engine.broadcast(None)
        return
    with folder.claimed(name, settings, wait) as ours:
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
