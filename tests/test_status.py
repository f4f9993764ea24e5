"""experiments.status: finished, training, paused and claimed runs, and the epochs left by the
early-stopping rule, read from the checkpoints of real (tiny) training runs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.training import EarlyStopping, SVITrainer, seed_everything
from experiments.records import CHECKPOINT, LOCK, RunFolder, new_record
from experiments.status import main as status_main
from experiments.status import sweep_status
from models.gat import build_node_classifier

from .conftest import random_graph


class Interrupted(Exception):
    """Stands for a session that ends mid-run."""


def interrupted_run(folder: RunFolder, name: str, val_losses: list[float], stopping: EarlyStopping,
                    max_epochs: int = 10, interrupted: bool = True) -> None:
    """A tiny GAT trained until its evaluation has run ``len(val_losses)`` times, checkpointed every
    epoch; the next evaluation interrupts it (``interrupted=False``: its training ends before)."""
    seed_everything(0)
    x, edge_index, y = random_graph(num_nodes=20, num_edges=60, seed=0)
    model = build_node_classifier(x.size(1), 3, BamConfig("wc", k=2.0), ObjectiveConfig())
    trainer = SVITrainer(model, AttentionGuide(model.model), torch.optim.Adam(model.parameters(), lr=0.01),
                         checkpoint=folder.run_dir(name) / CHECKPOINT, checkpoint_every=1)
    losses = iter(val_losses)

    def evaluate():
        loss = next(losses, None)
        if loss is None:
            raise Interrupted
        return {"val_loss": loss}

    batch = ((x, edge_index), dict(y=y, nodes=torch.arange(10)))
    if not interrupted:
        trainer.fit(lambda: [batch], evaluate, max_epochs, stopping, progress=False, steps_per_epoch=1)
        return
    with pytest.raises(Interrupted):
        trainer.fit(lambda: [batch], evaluate, max_epochs, stopping, progress=False, steps_per_epoch=1)


def test_status_tells_finished_paused_training_and_the_epochs_left(tmp_path):
    folder = RunFolder(tmp_path / "sweep")
    folder.save("toy-soft-seed0", new_record("toy", {"seed": 0}, {}, {"epochs": 7, "best_epoch": 4, "seconds": 3600.0}, 4000.0))
    # best at epoch 1, one epoch without improvement since: early stopping (patience 4) can end it
    # after 3 more epochs, max_epochs after 7
    interrupted_run(folder, "toy-wc-seed0", [1.0, 0.5, 0.7], EarlyStopping({"val_loss": "min"}, patience=4))
    # a warm-up of 3 epochs: nothing counted yet; the 4th epoch is the first best, then 4 more: 5 left
    interrupted_run(folder, "toy-wc-seed1", [1.0, 0.5, 0.7], EarlyStopping({"val_loss": "min"}, patience=4, start_epoch=3))
    folder.run_dir("toy-wc-seed2").mkdir(parents=True)

    with folder.claimed("toy-wc-seed1") as mine:
        assert mine
        table = sweep_status([folder.out]).set_index("run")
    assert table.loc["toy-soft-seed0", ["state", "epoch", "best epoch", "hours"]].tolist() == ["finished", 7, 4, 1.0]
    paused = table.loc["toy-wc-seed0"]
    assert paused[["state", "epoch", "step", "best epoch"]].tolist() == ["paused", 3, 0, 1]
    assert paused["last val_loss"] == "1, 0.5, 0.7" and paused["epochs left"] == "3.0-7.0"
    assert table.loc["toy-wc-seed1", "state"] == f"training (pid {os.getpid()})"
    assert table.loc["toy-wc-seed1", "epochs left"] == "5.0-7.0"
    assert table.loc["toy-wc-seed2", "state"] == "not started"
    # the claim is given back: nobody trains it now
    assert sweep_status([folder.out]).set_index("run").loc["toy-wc-seed1", "state"] == "paused"


def test_a_run_whose_training_is_over_is_scoring_or_paused_to_score(tmp_path):
    """Stopped early (patience 2 used up) or at max_epochs, with no record yet: its scores are due."""
    folder = RunFolder(tmp_path)
    interrupted_run(folder, "toy-wc-seed0", [1.0, 2.0, 3.0], EarlyStopping({"val_loss": "min"}, patience=2), interrupted=False)
    interrupted_run(folder, "toy-wc-seed1", [1.0, 0.9], EarlyStopping({"val_loss": "min"}, patience=2), max_epochs=2,
                    interrupted=False)
    interrupted_run(folder, "toy-wc-seed2", [1.0, 2.0], EarlyStopping({"val_loss": "min"}, patience=2))  # one more to go
    with folder.claimed("toy-wc-seed1"):
        table = sweep_status([folder.out]).set_index("run")
    assert table["state"].tolist() == ["paused (to score)", f"scoring (pid {os.getpid()})", "paused"]
    assert table["epochs left"].tolist() == ["0.0", "0.0", "1.0-8.0"]


def test_a_killed_holder_leaves_the_run_paused(tmp_path):
    folder = RunFolder(tmp_path)
    interrupted_run(folder, "toy-wc-seed0", [1.0], EarlyStopping({"val_loss": "min"}, patience=2))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder.run_dir("toy-wc-seed0") / LOCK).write_text(str(dead.pid))  # as a killed worker leaves it
    assert sweep_status([folder.out]).loc[0, "state"] == "paused"


def test_status_of_a_folder_without_runs_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        status_main([str(tmp_path)])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and error.count("\n") == 1 and "no runs in" in error


def test_a_damaged_file_is_reported_as_damaged_and_the_other_runs_as_usual(tmp_path, capsys):
    folder = RunFolder(tmp_path)
    interrupted_run(folder, "toy-wc-seed0", [1.0], EarlyStopping({"val_loss": "min"}, patience=2))  # healthy, paused
    interrupted_run(folder, "toy-wc-seed1", [1.0], EarlyStopping({"val_loss": "min"}, patience=2))
    checkpoint = folder.run_dir("toy-wc-seed1") / CHECKPOINT
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])  # cut short
    interrupted_run(folder, "toy-wc-seed2", [1.0, 2.0], EarlyStopping({"val_loss": "min"}, patience=1), interrupted=False)
    folder.save("toy-wc-seed2", new_record("toy", {"seed": 2}, {}, None, 1.0))  # finished, its checkpoint's checksum kept
    kept = bytearray((folder.run_dir("toy-wc-seed2") / CHECKPOINT).read_bytes())
    kept[len(kept) // 2] ^= 0xFF  # one changed byte among the parameters: loading would not notice
    (folder.run_dir("toy-wc-seed2") / CHECKPOINT).write_bytes(bytes(kept))
    folder.save("toy-wc-seed3", new_record("toy", {"seed": 3}, {}, None, 1.0))
    (folder.run_dir("toy-wc-seed3") / "record.json").write_text('{"task": "toy", "sett')

    states = status_main([str(folder.out)]).set_index("run")["state"]
    assert states["toy-wc-seed0"] == "paused"
    assert states["toy-wc-seed1"].startswith("damaged: checkpoint.pt (not a readable checkpoint")
    assert states["toy-wc-seed2"] == "damaged: checkpoint.pt (its checksum differs from the one in its run's record)"
    assert states["toy-wc-seed3"].startswith("damaged: record.json (not JSON")
    assert "Traceback" not in capsys.readouterr().err


def test_a_stale_lock_whose_pid_is_now_another_process_is_not_a_holder(tmp_path):
    """A killed worker's pid, taken since by an unrelated process, is not taken for the worker."""
    folder = RunFolder(tmp_path)
    interrupted_run(folder, "toy-wc-seed0", [1.0, 2.0, 3.0], EarlyStopping({"val_loss": "min"}, patience=2), interrupted=False)
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (folder.run_dir("toy-wc-seed0") / LOCK).write_text(str(unrelated.pid))  # a bare pid, as the old lock held
        assert sweep_status([folder.out]).loc[0, "state"] == "paused (to score)"
        with folder.claimed("toy-wc-seed0"):  # today's lock: pid and start time, left behind by a killed worker
            held = json.loads((folder.run_dir("toy-wc-seed0") / LOCK).read_text())
        (folder.run_dir("toy-wc-seed0") / LOCK).write_text(json.dumps({**held, "pid": unrelated.pid}))
        assert sweep_status([folder.out]).loc[0, "state"] == "paused (to score)"
    finally:
        unrelated.kill()
        unrelated.wait()
