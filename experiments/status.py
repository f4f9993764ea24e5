"""Where a sweep stands: one row per run of one or more output folders, finished or not.

    python -m experiments.status runs/nmt runs/nmt-2epochs

A run is ``finished`` (its record is written), ``training`` (a live process holds its claim: the
pid is shown), ``scoring`` (held, its training over by ``max_epochs`` or early stopping, its scores
and record to come), ``paused`` (a checkpoint and no process: the sweep's command resumes it; ``paused
(to score)`` once its training is over) or ``not started`` (a folder, no checkpoint and no process: a
run killed before its first checkpoint starts over), or ``damaged`` (its record or checkpoint cannot be
read back, or a finished run's checkpoint is not the one its record was saved with: the row names
the file and the reason, and the other runs are shown as usual). For the unfinished ones: the epoch and step reached,
the hours trained, the monitored metric's last values, the best epoch, and the epochs and hours
left: at most up to ``max_epochs``; at least until early stopping could end it (``patience`` epochs
without improvement, counted from the warm-up's end), at the run's mean time per epoch so far.
Reads unfinished runs' checkpoints without loading their tensors (memory-mapped), finished runs'
once to check their checksum, and takes no lock.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from bam_pyro.training import DamagedFile, read_checkpoint
from experiments.records import CHECKPOINT, RECORD, RunFolder


def epochs_done(state: dict[str, Any]) -> float:
    """Epochs a checkpointed run has trained, the current one's fraction included when known."""
    steps_per_epoch = (state.get("plan") or {}).get("steps_per_epoch")
    return state["epoch"] + (state["step_in_epoch"] / steps_per_epoch if steps_per_epoch else 0.0)


def epochs_left(state: dict[str, Any]) -> tuple[Optional[float], Optional[float]]:
    """(fewest, most) epochs a checkpointed run has left; None where the checkpoint does not say
    (it predates the saved plan)."""
    plan = state.get("plan") or {}
    done = epochs_done(state)
    most = plan["max_epochs"] - done if plan.get("max_epochs") is not None else None
    stopping = state.get("early_stopping") or {}
    if "patience" not in stopping:
        return (most if not stopping else None), most
    if stopping["best"]:  # it stops once patience - waited more epochs bring no improvement
        stop_after = state["epoch"] + stopping["patience"] - stopping["waited"]
    else:  # the first epoch it counts (none before the warm-up's end) is its best, then patience more
        stop_after = max(stopping.get("start_epoch", 0), state["epoch"]) + 1 + stopping["patience"]
    fewest = stop_after - done
    return (min(fewest, most) if most is not None else fewest), most


def run_status(folder: RunFolder, name: str) -> dict[str, Any]:
    """One run's row (see module doc)."""
    row: dict[str, Any] = {"folder": str(folder.out), "run": name}
    record = folder.record(name)
    if record is not None:
        folder.verify_checkpoint(name, record)
        training = record.get("training") or {}
        seconds = training.get("seconds", record["wall_seconds"])  # the training clock, as for unfinished runs
        return {**row, "state": "finished", "epoch": training.get("epochs"), "best epoch": training.get("best_epoch"),
                "hours": round(seconds / 3600, 2)}
    pid = folder.holder(name)
    checkpoint = folder.run_dir(name) / CHECKPOINT
    if not checkpoint.is_file():
        return {**row, "state": f"training (pid {pid})" if pid else "not started"}
    state = read_checkpoint(checkpoint, mmap=True)
    stopping = state.get("early_stopping") or {}
    monitors = list(stopping.get("monitors") or {})
    done = epochs_done(state)
    fewest, most = epochs_left(state)
    per_epoch = state["seconds"] / done if done else math.nan
    trained = fewest is not None and fewest <= 0
    if trained:  # stopped early or at max_epochs: nothing left to train, whatever max_epochs says
        fewest = most = 0.0
    if pid:
        label = f"{'scoring' if trained else 'training'} (pid {pid})"
    else:
        label = "paused (to score)" if trained else "paused"
    row.update({
        "state": label,
        "epoch": state["epoch"], "step": state["step_in_epoch"], "best epoch": stopping.get("best_epoch"),
        "hours": round(state["seconds"] / 3600, 2),
    })
    if monitors:
        last = [f"{h[monitors[0]]:.4g}" for h in state["history"][-3:] if monitors[0] in h]
        row[f"last {monitors[0]}"] = ", ".join(last)
    row["epochs left"] = _span(fewest, most, "{:.1f}")
    row["hours left"] = _span(*(None if e is None else e * per_epoch / 3600 for e in (fewest, most)), "{:.1f}")
    return row


def _checked_status(folder: RunFolder, name: str) -> dict[str, Any]:
    """:func:`run_status`, or a ``damaged`` row naming the file and the reason."""
    try:
        return run_status(folder, name)
    except DamagedFile as error:
        return {"folder": str(folder.out), "run": name, "state": f"damaged: {error.path.name} ({error.reason})"}


def _span(low: Optional[float], high: Optional[float], form: str) -> str:
    if low is None and high is None:
        return "?"
    if low is None or high is None or math.isclose(low, high):
        return form.format(low if high is None else high)
    return f"{form.format(max(low, 0.0))}-{form.format(high)}"


def sweep_status(folders: Sequence[Path]) -> pd.DataFrame:
    """Every run of the folders, finished or not, in folder and name order."""
    rows = []
    for out in folders:
        folder = RunFolder(out)
        names = sorted(p.name for p in (folder.out / "runs").glob("*") if p.is_dir())
        if not names:
            raise FileNotFoundError(f"no runs in {out} (no runs/*/): not an output folder?")
        rows += [_checked_status(folder, name) for name in names]
    table = pd.DataFrame(rows, dtype=object)  # object: whole numbers stay whole beside empty cells
    first = [c for c in ("folder", "run", "state", "epoch", "step", "best epoch", "hours") if c in table]
    last = [c for c in ("epochs left", "hours left") if c in table]
    return table[first + [c for c in table if c not in first + last] + last]


def main(argv: Optional[Sequence[str]] = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m experiments.status", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help=f"output folders of task scripts (runs/*/ with {RECORD} or {CHECKPOINT})")
    args = parser.parse_args(argv)
    try:
        table = sweep_status(args.folders)
    except FileNotFoundError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(table.fillna("").to_markdown(index=False, disable_numparse=True))
    return table


if __name__ == "__main__":
    main()
