"""Reloading runs: a finished run's model rebuilt from its record and checkpoint, for analyses
after the sweep."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Optional

import torch

from bam_pyro.training import metadata_differences
from experiments.records import CHECKPOINT, RECORD, RunFolder
from experiments.runner.task import RunSettings, Task


class TrainedRun(typing.NamedTuple):
    """A finished run, loaded: its settings, its panel's data and its model (eval mode)."""

    settings: RunSettings
    data: Any
    model: torch.nn.Module


def load_trained(task: Task, run_dir: os.PathLike, data_root: Optional[str] = None) -> TrainedRun:
    """The model of the finished run in ``run_dir`` (``<out>/runs/<run>``) as it was scored: the
    kept epoch's parameters under early stopping, else the last epoch's. The settings come from the
    run's record and the data from ``task.load``; errors name the run and what is missing."""
    run_dir = Path(run_dir)
    if task.build is None:
        raise ValueError(f"task {task.name!r} declares no build(settings, data): its models cannot be rebuilt")
    folder = RunFolder(run_dir.parent.parent)
    record = folder.record(run_dir.name)
    if record is None:
        state = "an unfinished run (it has a checkpoint)" if (run_dir / CHECKPOINT).is_file() else "not a run folder"
        raise ValueError(f"{run_dir}: no {RECORD}, {state}; pass the folder of a finished run, <out>/runs/<run>")
    if record["task"] != task.name:
        raise ValueError(f"{run_dir} is a run of task {record['task']!r}, not {task.name!r}")
    known = {f.name for f in dataclasses.fields(task.settings)}
    unknown = sorted(set(record["settings"]) - known)
    if unknown:
        raise ValueError(f"{run_dir}: its record has settings this version of {task.name} does not know: {unknown}")
    settings = task.settings(**record["settings"])
    if not (run_dir / CHECKPOINT).is_file():
        raise ValueError(f"{run_dir}: no {CHECKPOINT} (deleted?): the trained parameters are gone")
    folder.verify_checkpoint(run_dir.name, record)
    checkpoint = folder.finished_checkpoint(run_dir.name)
    differing = metadata_differences(checkpoint["metadata"], settings.row())
    if differing:
        raise ValueError(f"{run_dir}: its checkpoint was written with other settings than its record: {'; '.join(differing)}")
    data = task.load(settings, data_root)
    model = task.build(settings, data)
    kept = (checkpoint.get("early_stopping") or {}).get("best_state")
    model.load_state_dict(kept if kept is not None else checkpoint["model"])
    return TrainedRun(settings, data, model.eval())
