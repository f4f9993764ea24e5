"""The record of a finished run, and the output folder that holds a sweep's records.

One format for one idea, "the result of a run with these settings": ``<out>/runs/<run>/record.json``
holds the run's task, every setting, its metrics and its training history. Each run writes only its
own record (atomically), so processes sharing a folder never overwrite each other's results;
``results.csv`` (one row per run) is rebuilt from the records under a file lock. A folder holds one
setting per run: asking for a finished run, or resuming an unfinished one, with other settings is
refused by name instead of passing one setting's result off as another's. Several processes may
run the same sweep into one folder (one per core or GPU): each run is claimed by one of them
(:meth:`RunFolder.claimed`), the others go on to the next run. The claim's lock file says who
holds it (pid and process start time, so that a reused pid is not taken for the holder) and with
which settings, so that another sweep's runs of other settings are refused before they train.
Writes are atomic (:func:`write_atomically`): one that fails leaves no partial file and raises
:class:`~bam_pyro.training.WriteFailed`, naming the folder.

Every file is checked when it is read: a record that is not a record (its entries of the wrong
type; a metric that is not a finite number, unless the record says under ``missing`` why it has
none, as for a run that diverged), or a checkpoint that cannot be read back, raises
:class:`~bam_pyro.training.DamagedFile` naming it, the entry and what to do. A record
holds its run's checkpoint's checksum (taken when the record is saved, once the checkpoint is
final), so that a finished run's damaged checkpoint is found before it is used, even a change that
loading would not notice; an unfinished run's checkpoint is verified by loading.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
import zipfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from bam_pyro.training import DamagedFile, WriteFailed, read_checkpoint, require_same_metadata, same_setting

RECORD = "record.json"
CHECKPOINT = "checkpoint.pt"
LOCK = ".lock"
#: the record's entry that holds the checksum of its run's checkpoint
CHECKPOINT_SHA256 = "checkpoint_sha256"
#: what each entry of a record must be for the record to be read
RECORD_SHAPE = {"task": str, "settings": dict, "metrics": dict, "wall_seconds": (int, float)}
#: the record's entry that says, per metric that has no value (null), why: a run that diverged, say
MISSING = "missing"
#: what to do about a damaged file, by the run it belongs to
REDO_RECORD = "delete it to redo that run (from its checkpoint, if it kept one), or restore it from a copy"
RETRAIN_UNFINISHED = "delete it to retrain that run from the start, or restore it from a copy"
RETRAIN_FINISHED = "delete that run's folder to retrain it, or restore the file from a copy"


class SettingsMismatch(ValueError):
    """A run asked for with other settings than the folder's run of the same name."""


def setting_differences(recorded: Mapping[str, Any], asked: Mapping[str, Any], other: str = "asked for") -> list[str]:
    """``name=recorded (<other> value)`` for every setting that differs; a setting the record
    lacks (written before the setting existed) may have had any value, so it differs too."""
    differing = []
    for name, value in asked.items():
        if name not in recorded:
            differing.append(f"{name}=not recorded ({other} {value!r})")
        elif not same_setting(recorded[name], value):
            differing.append(f"{name}={recorded[name]!r} ({other} {value!r})")
    return differing


def read_record(path: Path) -> dict[str, Any]:
    """The record in ``path``; :class:`~bam_pyro.training.DamagedFile` if it is not JSON of a
    record's shape (cut short, overwritten, edited)."""
    try:
        record = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedFile(path, f"not JSON: {error}", REDO_RECORD) from None
    if not isinstance(record, dict):
        raise DamagedFile(path, "not a record: not a JSON object", REDO_RECORD)
    wrong = [key for key, kind in RECORD_SHAPE.items() if not isinstance(record.get(key), kind)]
    if wrong:
        raise DamagedFile(path, f"not a record: no valid {', '.join(wrong)}", REDO_RECORD)
    problem = metric_problem(record)
    if problem:
        raise DamagedFile(path, problem, REDO_RECORD)
    return record


def metric_problem(record: Mapping[str, Any]) -> Optional[str]:
    """What is wrong with the record's metrics, None if nothing: each must be a finite number, or
    null with the reason under ``missing``. A NaN passed over would shrink a mean's sample while its
    count stays, and a string would end a table in a traceback."""
    missing = record.get(MISSING) or {}
    if not isinstance(missing, dict):
        return f"not a record: {MISSING} is not an object"
    for name, value in record["metrics"].items():
        if value is None:
            if not isinstance(missing.get(name), str):
                return f"metric {name!r} is null and the record does not say why (no {MISSING}[{name!r}])"
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"metric {name!r} is not a number: {value!r}"
        elif not math.isfinite(value):
            return f"metric {name!r} is {value}, not a finite number"
    return None


def file_sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def require_writable_folder(path: os.PathLike, option: str = "--out", room: int = 0) -> None:
    """Raise ``ValueError`` naming ``option`` unless ``path`` is a folder this process may write
    in, or one it may create, with ``room`` bytes free (a checkpoint is written beside the one it
    replaces). Tried by writing (and removing) a file in the nearest existing folder: permission
    bits do not tell (root ignores them), nor do read-only file systems."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." or "/" at the latest
    if not existing.is_dir():
        where = "is" if existing == path else f"is inside {existing}, which is"
        raise ValueError(f"{option} {path} {where} a file, not a folder: choose a folder")
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".write-test-")
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot write in {existing} ({error.strerror}): choose another folder") from None
    os.close(handle)
    os.unlink(probe)
    free = shutil.disk_usage(existing).free
    if free < room:
        raise ValueError(f"{option} {path}: {existing} has {free / 2**20:.1f} MiB free, and a checkpoint of these runs "
                         f"takes {room / 2**20:.1f} MiB: free some room or choose another folder")


def source_commit(root: os.PathLike = Path(__file__).resolve().parents[1]) -> Optional[str]:
    """The git commit of the checkout at ``root`` (this one), ``+changes`` if tracked files differ
    from it; None outside a git checkout or without git."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if changes else "")


#: the code a process runs is the code it imported: its commit is taken then, not when a record is written
SOURCE_COMMIT = source_commit()


def versions() -> dict[str, str]:
    """The versions a result depends on, recorded with it: packages, and the source's commit."""
    found = {}
    for package in ("bam-pyro", "torch", "pyro-ppl", "torch-geometric", "transformers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    if SOURCE_COMMIT is not None:
        found["bam-pyro commit"] = SOURCE_COMMIT
    return found


def flatten(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record as one results-table row: task, settings, metrics, then training figures (and why a
    metric has no value, if one has none)."""
    training = record.get("training") or {}
    summary = {k: training[k] for k in ("epochs", "best_epoch", "seconds") if k in training}
    missing = {MISSING: "; ".join(f"{k}: {v}" for k, v in record[MISSING].items())} if record.get(MISSING) else {}
    return {"task": record["task"], **record["settings"], **record["metrics"], **summary,
            "wall_seconds": record["wall_seconds"], **missing}


class RunFolder:
    """An output folder: ``runs/<run>/`` per run (record, checkpoint, artifacts), ``results.csv``
    and the tables and figures drawn from them."""

    def __init__(self, out: os.PathLike) -> None:
        self.out = Path(out)

    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / name

    def record(self, name: str) -> Optional[dict[str, Any]]:
        path = self.run_dir(name) / RECORD
        return read_record(path) if path.is_file() else None

    def largest_checkpoint(self) -> int:
        """The size in bytes of the folder's largest checkpoint (0 if none): the room a run of its
        sweep needs to write one more (runs of one sweep have checkpoints of about one size)."""
        return max((p.stat().st_size for p in self.out.glob(f"runs/*/{CHECKPOINT}")), default=0)

    def finished(self, name: str, task: str, settings: Mapping[str, Any]) -> bool:
        """Whether run ``name`` is finished; raises :class:`SettingsMismatch`, naming the
        settings, if it was finished with other ones, and ``DamagedFile`` if its record or kept
        checkpoint is damaged."""
        record = self.record(name)
        if record is None:
            return False
        differing = setting_differences(record["settings"], settings)
        if record["task"] != task:
            differing.insert(0, f"task={record['task']!r} (asked for {task!r})")
        if differing:
            raise SettingsMismatch(f"{self.run_dir(name)} holds a finished run with other settings: "
                                   f"{'; '.join(differing)}. Choose another --out for the new settings.")
        self.verify_checkpoint(name, record)
        return True

    def verify_checkpoint(self, name: str, record: Mapping[str, Any]) -> None:
        """The finished run's checkpoint, if it kept one, is the file its record was saved with:
        its checksum, or for records older than checksums, a load."""
        path = self.run_dir(name) / CHECKPOINT
        if not path.is_file():
            return
        expected = record.get(CHECKPOINT_SHA256)
        if expected is None:
            self.finished_checkpoint(name, mmap=True)
        elif file_sha256(path) != expected:
            raise DamagedFile(path, "its checksum differs from the one in its run's record", RETRAIN_FINISHED)

    def finished_checkpoint(self, name: str, mmap: bool = False) -> dict[str, Any]:
        """The checkpoint of finished run ``name``, read (see :meth:`verify_checkpoint` first)."""
        path = self.run_dir(name) / CHECKPOINT
        try:
            return read_checkpoint(path, mmap=mmap)
        except DamagedFile as error:
            raise DamagedFile(path, error.reason, RETRAIN_FINISHED) from None

    def require_resumable(self, name: str, settings: Mapping[str, Any]) -> None:
        """An unfinished run's checkpoint, if there is one, can be read and was written with
        ``settings`` (else ``DamagedFile`` or ``ValueError``, naming it): checked before any
        data load, by reading its plain values (memory-mapped)."""
        path = self.run_dir(name) / CHECKPOINT
        if not path.is_file():
            return
        try:
            state = read_checkpoint(path, mmap=True)
        except DamagedFile as error:
            raise DamagedFile(path, error.reason, RETRAIN_UNFINISHED) from None
        require_same_metadata(path, state["metadata"], dict(settings))

    @contextmanager
    def claimed(self, name: str, settings: Optional[Mapping[str, Any]] = None, wait: bool = False) -> Iterator[bool]:
        """Hold run ``name`` for this process while the block runs: True if no other process holds
        it, False if one does (it is training the run); with ``wait``, wait until none does. An
        advisory lock on ``runs/<run>/.lock`` that the system lets go of however the holder ends, so
        a killed run is free to resume. The lock file says who holds it (pid and the process's start
        time: a pid alone may be a later, unrelated process's) and with which ``settings``."""
        path = self.run_dir(name)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / LOCK, "a+") as lock:  # not "w": truncating would erase the holder's pid
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            holder = {"pid": os.getpid(), "started": process_start(os.getpid()), "settings": dict(settings or {})}
            try:
                lock.truncate(0)
                lock.write(json.dumps(holder, default=_plain))  # who trains it, for experiments.status
                lock.flush()
            except OSError as error:
                raise WriteFailed(path, error) from None
            try:
                yield True
            finally:
                lock.truncate(0)

    def holder(self, name: str) -> Optional[int]:
        """The pid of the live process that holds run ``name`` (see :meth:`claimed`), else None.
        Read without taking the lock, so that looking never keeps a worker from a run."""
        held = self._holding(name)
        return None if held is None else held["pid"]

    def _holding(self, name: str) -> Optional[dict[str, Any]]:
        """The lock file's holder (pid, start time, settings) if that process still lives."""
        try:
            held = json.loads((self.run_dir(name) / LOCK).read_text() or "null")
        except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(held, dict) or not isinstance(held.get("pid"), int) or held["pid"] <= 0:
            return None  # released, or written by an older version (a bare pid: no way to tell it is still that process)
        if held.get("started") is None:  # written where /proc is not: the pid is all there is
            return held if _alive(held["pid"]) else None
        if process_start(held["pid"]) != held["started"]:
            return None  # the holder died; its pid is free, or another process's now
        return held

    def in_progress(self, task_settings: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
        """The runs other live processes are training in this folder, as ``{"run", "file",
        "settings"}`` (``file``: the lock that says so), for :func:`~experiments.runner.sweep.require_agreement`."""
        found = []
        for lock in sorted(self.out.glob(f"runs/*/{LOCK}")):
            held = self._holding(lock.parent.name)
            if held is not None and held["pid"] != os.getpid() and held.get("settings"):
                found.append({"run": lock.parent.name, "file": lock, "settings": held["settings"]})
        return found

    def save(self, name: str, record: Mapping[str, Any]) -> Path:
        """Write a run's record atomically (a reader never sees half a file), with the checksum
        of the run's checkpoint if it has one (final now that the run is)."""
        path = self.run_dir(name) / RECORD
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint = path.with_name(CHECKPOINT)
        if checkpoint.is_file():
            record = {**record, CHECKPOINT_SHA256: file_sha256(checkpoint)}
        write_atomically(path, lambda partial: partial.write_text(json.dumps(record, indent=1, default=_plain)))
        return path

    def records(self) -> list[dict[str, Any]]:
        """Every finished run's record, with its run's name (``run``) and file (``file``)."""
        return [{**read_record(p), "run": p.parent.name, "file": p} for p in sorted(self.out.glob(f"runs/*/{RECORD}"))]

    def write_results(self) -> pd.DataFrame:
        """``results.csv`` rebuilt from every record in the folder (under a lock, so that of two
        processes finishing at once the later one writes both runs)."""
        self.out.mkdir(parents=True, exist_ok=True)
        with _locked(self.out / ".results.lock"):
            results = pd.DataFrame([flatten(r) for r in self.records()])
            write_atomically(self.out / "results.csv", lambda partial: results.to_csv(partial, index=False))
        return results


def write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(partial)`` then the partial file renamed to ``path``: a reader sees the old file or
    the new one, never half of one. A failed write (a full disk) leaves no partial file behind and
    raises :class:`~bam_pyro.training.WriteFailed`, naming the folder and the reason."""
    partial = path.with_name(f".{path.stem}-{os.getpid()}{path.suffix}")  # the suffix kept: it tells a format
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException as error:
        partial.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise WriteFailed(path.parent, error) from None
        raise


def read_arrays(path: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The arrays ``names`` of the ``.npz`` artifact ``path``, read whole (no pickled objects);
    :class:`~bam_pyro.training.DamagedFile` naming the file if it is cut short, not an archive, or
    lacks one of them."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [name for name in names if name not in archive.files]
            if missing:
                raise DamagedFile(path, f"no array {', '.join(map(repr, missing))} (it holds {archive.files})", REDO_RECORD)
            return {name: archive[name] for name in names}
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as error:
        if isinstance(error, DamagedFile) or isinstance(error, (FileNotFoundError, PermissionError)):
            raise
        raise DamagedFile(path, f"not a readable .npz: {str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}",
                          REDO_RECORD) from None


def new_record(task: str, settings: Mapping[str, Any], metrics: Mapping[str, Any],
               training: Optional[Mapping[str, Any]], wall_seconds: float,
               environment: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """A run's record. ``environment``: where it ran (devices, processes, strategy, precision,
    whether torch's deterministic algorithms were on: :meth:`bam_pyro.distributed.LocalEngine.describe`)."""
    metrics = dict(metrics)
    missing = {name: f"the run gave {value}" for name, value in metrics.items()
               if isinstance(value, float) and not math.isfinite(value)}  # diverged: no value, and why
    metrics.update(dict.fromkeys(missing))
    record = {
        "task": task, "settings": dict(settings), "metrics": metrics,
        "training": dict(training) if training else None, "wall_seconds": round(wall_seconds, 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
    }
    if missing:
        record[MISSING] = missing
    if environment is not None:
        record["environment"] = dict(environment)
    return record


def read_folders(folders: Sequence[os.PathLike]) -> list[dict[str, Any]]:
    """The records of several output folders, in order (a folder without any is an error)."""
    records = []
    for folder in folders:
        found = RunFolder(folder).records()
        if not found:
            raise FileNotFoundError(f"no finished runs in {folder} (no runs/*/{RECORD}): not an output folder?")
        records += [{**r, "folder": str(folder)} for r in found]
    return records


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``): with its pid, it names
    one process, where a pid alone is reused. None if no such process lives (or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22, starttime; the name in (...) may hold spaces


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _plain(value: Any) -> Any:
    """JSON for NumPy scalars and paths in metrics."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
