"""Runs and records that cannot lie (issue 45, and the shared sweep and damaged data of issue 42):
no mixed settings pooled, no NaN dropped silently, no code run from a data file, a failed write
leaving nothing behind, Ctrl-C ending in one line, damaged data and artifacts named in one line.
Each row is tried on the real command (a subprocess where processes meet, else in-process)."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import math
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.io import read_planetoid_data
from torch_geometric.transforms import NormalizeFeatures

from bam_pyro.training import read_checkpoint
from experiments import collect, results
from experiments.captioning.captions import read_flickr_subset
from experiments.gat import task as gat
from experiments.gat.planetoid import RAW_PARTS, load_planetoid
from experiments.glue.data import read_split as read_glue
from experiments.nmt.multi30k import read_split as read_multi30k
from experiments.records import RunFolder, new_record
from experiments.runner import run_cli

from .test_runs import TOY, ToySettings

REPO = Path(__file__).resolve().parents[1]
GAT = ("--variant", "soft", "--no-progress", "--threads", "1")


def _gat_process(data_root: Path, out: Path, *extra: str, **options) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "experiments.gat", *GAT, "--data-root", str(data_root), "--out", str(out),
                             *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)


def _interruptible() -> None:
    """In the child: SIGINT at its default, as in a terminal. A test session started in the
    background by a shell without job control ignores SIGINT, and its children inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _wait_for(condition, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def _claimed(out: Path) -> bool:
    return any(lock.stat().st_size > 0 for lock in out.glob("runs/*/.lock"))


# --- settings agree, or nothing is pooled ------------------------------------------------------


def test_concurrent_sweeps_with_other_settings_into_one_folder_pool_nothing(tmp_path, data_root):
    """Both plan before either has a record; the one that claims second sees the other's run."""
    out = tmp_path / "gat"
    first = _gat_process(data_root, out, "--seeds", "0", "--max-epochs", "150")
    _wait_for(lambda: _claimed(out) or first.poll() is not None)
    second = _gat_process(data_root, out, "--seeds", "1", "--max-epochs", "151")
    (_, first_err), (_, second_err) = first.communicate(), second.communicate()
    assert first.returncode == 0, first_err
    assert second.returncode == 2 and _one_line(second_err), second_err
    assert "max_epochs=150 / 151" in second_err and "cora-soft-seed0" in second_err and "cora-soft-seed1 (asked for)" in second_err
    assert [p.parent.name for p in out.glob("runs/*/record.json")] == ["cora-soft-seed0"]


def test_a_run_found_finished_with_other_settings_after_the_plan_ends_in_one_line(tmp_path, capsys):
    out = tmp_path / "toy"

    def load_while_another_process_finishes_it(settings, root):
        RunFolder(out).save("a-soft-seed0", new_record("toy", ToySettings(lr=0.3).row(), {"score": 1.0}, None, 0.0))
        return 1.0

    toy = dataclasses.replace(TOY, load=load_while_another_process_finishes_it)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(toy, ["--dataset", "a", "--variant", "soft", "--seeds", "0", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and _one_line(err) and "lr=0.3 (asked for 0.1)" in err, err
    assert not (out / "results.csv").exists()


def _published(tmp_path: Path) -> tuple[Path, Path]:
    """Copies of the committed records the GAT task publishes from, and of the docs outputs they give."""
    records, docs = tmp_path / "results", tmp_path / "docs"
    for source in {spec.source for spec in results.PUBLISHED["gat"]}:
        shutil.copytree(REPO / "results" / source, records / source)
    shutil.copytree(REPO / "docs" / "results", docs)
    return records, docs


def _edit_record(path: Path, edit) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record, indent=1))


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(capsys, main, argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and _one_line(err), err
    return err


@pytest.mark.parametrize("change", ["lacks", "adds"])
def test_a_record_lacking_or_adding_a_setting_is_not_pooled(change, tmp_path, capsys):
    records, docs = _published(tmp_path)
    path = records / "gat" / "runs" / "cora-wc-seed3" / "record.json"
    _edit_record(path, (lambda r: r["settings"].pop("dropout_per_head")) if change == "lacks"
                 else (lambda r: r["settings"].update(new_setting=1.5)))
    before = _snapshot(docs)
    err = _refused(capsys, results.main, ["gat", "--records", str(records), "--out", str(docs)])
    setting = "dropout_per_head" if change == "lacks" else "new_setting"
    assert str(path) in err and "cora-wc-seed3" in err and setting in err and "not recorded" in err, err
    assert _snapshot(docs) == before
    err = _refused(capsys, collect.main, [str(records / "gat"), "--out", str(tmp_path / "collected")])
    assert str(path) in err and setting in err, err


# --- every metric a finite number or an explicit absence ----------------------------------------


@pytest.mark.parametrize("value, words", [(math.nan, "is nan"), ("82.1", "is not a number: '82.1'")])
def test_a_nan_or_string_metric_is_named_not_averaged(value, words, tmp_path, capsys):
    records, docs = _published(tmp_path)
    path = records / "gat" / "runs" / "cora-wc-seed3" / "record.json"
    _edit_record(path, lambda r: r["metrics"].update(test_acc=value))
    before = _snapshot(docs)
    err = _refused(capsys, results.main, ["gat", "--records", str(records), "--out", str(docs)])
    assert str(path) in err and "'test_acc'" in err and words in err, err
    assert _snapshot(docs) == before
    err = _refused(capsys, collect.main, [str(records / "gat"), "--out", str(tmp_path / "collected")])
    assert str(path) in err and "'test_acc'" in err, err


def test_a_run_that_diverged_is_recorded_without_its_value_and_the_table_says_so(tmp_path):
    def diverging(settings, data, run):
        return {"score": math.nan if settings.seed == 1 else 1.0 + settings.seed + (settings.variant == "wc")}

    toy = dataclasses.replace(TOY, train=diverging)
    out = tmp_path / "toy"
    tables = run_cli(toy, ["--dataset", "a", "--variant", "soft", "wc", "--seeds", "0", "1", "2", "--out", str(out)])
    record = json.loads((out / "runs" / "a-wc-seed1" / "record.json").read_text())
    assert record["metrics"]["score"] is None and record["missing"] == {"score": "the run gave nan"}
    table = tables["results"].set_index(["dataset", "variant"])
    assert table.loc[("a", "wc"), "n"] == 2  # the values averaged, not the runs
    assert table.loc[("a", "wc"), "score"] == "3.00 ± 1.41"  # seeds 0 and 2: 2 and 4
    assert table.loc[("a", "wc"), "left out"] == "seed 1 (score: the run gave nan)"
    assert table.loc[("a", "wc"), "score - soft (paired)"].startswith("+1.00 ± 0.00")


# --- no code runs from a data file ------------------------------------------------------------


class _Payload:
    """Unpickling it touches the marker: what a crafted data file could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _planetoid_root(tmp_path: Path, data_root: Path) -> Path:
    raw = tmp_path / "data" / "planetoid" / "Cora" / "raw"
    raw.mkdir(parents=True)
    for part in RAW_PARTS:
        shutil.copyfile(data_root / "planetoid" / "Cora" / "raw" / f"ind.cora.{part}", raw / f"ind.cora.{part}")
    return tmp_path / "data"


def test_a_malicious_raw_planetoid_file_runs_nothing_and_is_named(tmp_path, data_root, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root, marker = _planetoid_root(tmp_path, data_root), tmp_path / "marker"
    crafted = root / "planetoid" / "Cora" / "raw" / "ind.cora.x"
    crafted.write_bytes(pickle.dumps(_Payload(marker)))
    err = _refused(capsys, gat.main, [*GAT, "--seeds", "0", "--data-root", str(root), "--out", str(tmp_path / "out")])
    assert not marker.exists()
    assert str(crafted) in err and "refused" in err, err


def test_a_malicious_processed_cache_runs_nothing_and_is_rebuilt(tmp_path, data_root, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root, marker = _planetoid_root(tmp_path, data_root), tmp_path / "marker"
    expected = load_planetoid("cora", root)[0]
    [processed] = (tmp_path / "cache").rglob("processed/data.pt")
    torch.save({"data": _Payload(marker)}, processed)
    with pytest.warns(UserWarning, match="rebuilt"):
        graph = load_planetoid("cora", root)[0]
    assert not marker.exists()
    assert torch.equal(graph.x, expected.x) and torch.equal(graph.edge_index, expected.edge_index)
    pyg = NormalizeFeatures()(read_planetoid_data(str(data_root / "planetoid" / "Cora" / "raw"), "cora"))  # PyG's own read
    assert all(torch.equal(graph[key], pyg[key]) for key in ("x", "edge_index", "y", "train_mask", "val_mask", "test_mask"))


@pytest.mark.parametrize("part", ["x", "graph"])
def test_a_truncated_raw_planetoid_file_is_named(part, tmp_path, data_root, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = _planetoid_root(tmp_path, data_root)
    cut = root / "planetoid" / "Cora" / "raw" / f"ind.cora.{part}"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    err = _refused(capsys, gat.main, [*GAT, "--seeds", "0", "--data-root", str(root), "--out", str(tmp_path / "out")])
    assert str(cut) in err, err


# --- writes that fail leave nothing behind ----------------------------------------------------


def _file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_checkpoint_write_that_fails_ends_in_one_line_and_leaves_no_partial_file(tmp_path, data_root):
    load_planetoid("cora", data_root)  # the data cache written beforehand, under no limit
    out = tmp_path / "out"
    run = _gat_process(data_root, out, "--seeds", "0", "--max-epochs", "2", preexec_fn=_file_size_limit(200_000))
    _, err = run.communicate()
    assert run.returncode == 2 and _one_line(err), err
    assert str(out / "runs" / "cora-soft-seed0") in err and "file too large" in err, err
    assert not [p for p in out.rglob("*") if p.is_file() and p.name != ".lock"]


def test_the_folder_check_asks_for_room_for_a_checkpoint(tmp_path, data_root, monkeypatch, capsys):
    run = tmp_path / "out" / "runs" / "cora-soft-seed1"
    run.mkdir(parents=True)
    (run / "checkpoint.pt").write_bytes(b"\0" * 300_000)  # a sibling run's checkpoint: this sweep's size
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100_000, 100_000))
    err = _refused(capsys, gat.main, [*GAT, "--seeds", "0", "--data-root", str(data_root), "--out", str(tmp_path / "out")])
    assert "--out" in err and "0.1 MiB free" in err and "0.3 MiB" in err, err


# --- SIGINT -----------------------------------------------------------------------------------


def test_ctrl_c_ends_in_one_line_status_130_and_a_valid_checkpoint(tmp_path, data_root):
    out = tmp_path / "out"
    # no early stop either: on a loaded machine the run must still be training when the signal comes
    run = _gat_process(data_root, out, "--seeds", "0", "--max-epochs", "100000", "--patience", "100000",
                       "--checkpoint-minutes", "0", preexec_fn=_interruptible)
    checkpoint = out / "runs" / "cora-soft-seed0" / "checkpoint.pt"
    _wait_for(lambda: checkpoint.is_file() or run.poll() is not None)
    time.sleep(1.0)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate()
    assert run.returncode == 130 and _one_line(err) and "interrupted" in err, err
    assert read_checkpoint(checkpoint)["epoch"] >= 0
    assert not list(out.rglob("*.tmp"))


# --- damaged artifacts and data: one line naming the file ------------------------------------


@pytest.mark.parametrize("how", ["truncated", "mis-keyed"])
def test_a_damaged_npz_leaves_the_docs_untouched(how, tmp_path, capsys):
    records, docs = _published(tmp_path)
    [artifact, *_] = sorted((records / "graph").rglob("*.npz"))
    if how == "truncated":
        artifact.write_bytes(artifact.read_bytes()[: artifact.stat().st_size // 2])
    else:
        with artifact.open("wb") as file:
            np.savez(file, probabilities=np.zeros((2, 3)), labels=np.zeros(2))
    before = _snapshot(docs)
    err = _refused(capsys, results.main, ["gat", "--records", str(records), "--out", str(docs)])
    assert str(artifact) in err, err
    assert _snapshot(docs) == before


def test_a_glue_row_with_an_extra_column_is_named(tmp_path, data_root):
    folder = tmp_path / "glue" / "RTE"
    folder.mkdir(parents=True)
    lines = (data_root / "glue" / "RTE" / "dev.tsv").read_text(encoding="utf-8").splitlines()[:8]
    lines[5] += "\textra"
    (folder / "dev.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{folder / 'dev.tsv'}.*line 6"):
        read_glue("rte", "dev", tmp_path)


def test_a_multi30k_line_that_is_not_utf8_is_named_with_its_line(tmp_path):
    folder = tmp_path / "multi30k"
    folder.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            with gzip.open(folder / f"{split}.{lang}.gz", "wb") as file:
                file.write(b"a dog runs\n" + (b"\xff\xfe bad\n" if (split, lang) == ("train", "de") else b"one more\n"))
    with pytest.raises(ValueError, match=f"{folder / 'train.de.gz'}, line 2: not UTF-8"):
        read_multi30k("train", tmp_path)
    (folder / "val.en.gz").write_bytes((folder / "val.en.gz").read_bytes()[:12])
    with pytest.raises(ValueError, match=f"{folder / 'val.en.gz'}, line 1: not a whole gzip file"):
        read_multi30k("val", tmp_path)


def test_a_caption_line_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "captions.txt").write_bytes(b"image,caption\na.jpg,a dog\nb.jpg,a \xff cat\n")
    with pytest.raises(ValueError, match=f"{tmp_path / 'captions.txt'}, line 3: not UTF-8"):
        read_flickr_subset(tmp_path)


# --- the shared sweep ends cleanly ------------------------------------------------------------


def test_two_processes_on_one_sweep_both_end_with_status_0_and_train_it_once(tmp_path, data_root):
    out = tmp_path / "gat"
    first = _gat_process(data_root, out, "--seeds", "0", "--max-epochs", "150")
    _wait_for(lambda: _claimed(out) or first.poll() is not None)
    second = _gat_process(data_root, out, "--seeds", "0", "--max-epochs", "150")
    waiting = _gat_process(data_root, out, "--seeds", "0", "--max-epochs", "150", "--wait")
    outputs = [process.communicate() for process in (first, second, waiting)]
    for process, (stdout, stderr) in zip((first, second, waiting), outputs):
        assert process.returncode == 0 and "Traceback" not in stderr, stderr
    trained = [stdout for stdout, _ in outputs if "cora soft seed 0:" in stdout]
    assert len(trained) == 1, outputs
    assert "being trained by another process" in outputs[1][0] and "--wait waits for them" in outputs[1][0], outputs[1]
    assert "| cora " in outputs[2][0], outputs[2]  # waited, then tabulated the run the first trained
