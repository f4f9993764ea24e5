"""The fault table of a run: damaged files, unusable output folders, conflicting settings and
records, and options a variant cannot use, each tried on a real CLI (in-process, as a user would
type it). Every row must end with status 2 and one line naming the file or the option, with no
traceback, before the data are loaded (the loaders are replaced by ones that fail the test), and
leave every file of the folders involved as it was (checksums before and after)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import pytest

from bam_pyro.training import DamagedFile
from experiments import collect, curves
from experiments.gat import task as gat
from experiments.nmt import search as nmt_search
from experiments.nmt import task as nmt
from experiments.nmt import uncertainty as nmt_uncertainty
from experiments.vqa import task as vqa
from experiments.runner import load_trained

RUN = "cora-soft-seed0"
GAT_ARGS = ("--variant", "soft", "--seeds", "0", "--max-epochs", "1", "--no-progress", "--threads", "1")
NOBODY = 65534


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_root) -> Path:
    """An output folder holding one finished GAT run, trained by the CLI for one epoch."""
    out = tmp_path_factory.mktemp("faults") / "finished"
    gat.main([*GAT_ARGS, "--data-root", str(data_root), "--out", str(out)])
    assert (out / "runs" / RUN / "checkpoint.pt").is_file()
    return out


class Row(NamedTuple):
    """One fault: the command, the folders it must leave alone and the words its one line must hold."""

    main: Callable[[Sequence[str]], object]
    argv: list[str]
    watched: list[Path]
    words: list[str]
    unprivileged: bool = False


def _gat(out: Path, *extra: str) -> list[str]:
    return [*GAT_ARGS, "--out", str(out), *extra]


def _copy(finished: Path, tmp: Path, name: str = "out") -> Path:
    return Path(shutil.copytree(finished, tmp / name))


def _damage(path: Path, how: str) -> None:
    """``cut``: the first half only (a copy broken off); ``flip``: one byte of the middle inverted."""
    data = bytearray(path.read_bytes())
    if how == "cut":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def damaged_checkpoint_of_an_unfinished_run(finished: Path, tmp: Path) -> Row:
    out = _copy(finished, tmp)
    (out / "runs" / RUN / "record.json").unlink()
    _damage(out / "runs" / RUN / "checkpoint.pt", "cut")
    return Row(gat.main, _gat(out), [out], [str(out / "runs" / RUN / "checkpoint.pt"), "delete it"])


def damaged_checkpoint_of_a_finished_run(finished: Path, tmp: Path) -> Row:
    """A flipped byte in the parameters: torch.load reads it back without complaint."""
    out = _copy(finished, tmp)
    _damage(out / "runs" / RUN / "checkpoint.pt", "flip")
    return Row(gat.main, _gat(out), [out], [str(out / "runs" / RUN / "checkpoint.pt"), "delete"])


def damaged_record(finished: Path, tmp: Path) -> Row:
    out = _copy(finished, tmp)
    _damage(out / "runs" / RUN / "record.json", "cut")
    return Row(gat.main, _gat(out), [out], [str(out / "runs" / RUN / "record.json"), "delete it"])


def record_of_another_shape(finished: Path, tmp: Path) -> Row:
    out = _copy(finished, tmp)
    (out / "runs" / RUN / "record.json").write_text(json.dumps({"task": "gat"}))
    return Row(gat.main, _gat(out), [out], [str(out / "runs" / RUN / "record.json"), "delete it"])


def out_is_a_file(finished: Path, tmp: Path) -> Row:
    out = tmp / "results.txt"
    out.write_text("not a folder\n")
    return Row(gat.main, _gat(out), [out], ["--out", str(out), "not a folder"])


def out_under_a_file(finished: Path, tmp: Path) -> Row:
    (tmp / "results.txt").write_text("not a folder\n")
    return Row(gat.main, _gat(tmp / "results.txt" / "gat"), [tmp], ["--out", str(tmp / "results.txt")])


def out_unwritable(finished: Path, tmp: Path) -> Row:
    """A folder without write permission, the CLI run by a user other than root (root may write anywhere)."""
    out = tmp / "locked"
    out.mkdir()
    return Row(gat.main, _gat(out), [out], ["--out", str(out), "cannot write"], unprivileged=True)


def unfinished_run_with_other_settings(finished: Path, tmp: Path) -> Row:
    out = _copy(finished, tmp)
    (out / "runs" / RUN / "record.json").unlink()
    return Row(gat.main, _gat(out, "--lr", "0.01"), [out], [str(out / "runs" / RUN / "checkpoint.pt"), "lr=0.005"])


def finished_run_with_other_settings(finished: Path, tmp: Path) -> Row:
    out = _copy(finished, tmp)
    return Row(gat.main, _gat(out, "--lr", "0.01"), [out], [str(out / "runs" / RUN), "lr=0.005"])


def merge_of_one_run_with_other_settings(finished: Path, tmp: Path) -> Row:
    first, second = _copy(finished, tmp, "first"), _copy(finished, tmp, "second")
    path = second / "runs" / RUN / "record.json"
    record = json.loads(path.read_text())
    record["settings"]["lr"] = 0.01
    path.write_text(json.dumps(record))
    merged = tmp / "merged"
    return Row(collect.main, [str(first), str(second), "--out", str(merged)], [first, second, merged],
               [RUN, str(first), str(second), "lr=0.005", "0.01"])


def collect_into_a_file(finished: Path, tmp: Path) -> Row:
    out = tmp / "results.txt"
    out.write_text("not a folder\n")
    return Row(collect.main, [str(finished), "--out", str(out)], [finished, out], ["--out", str(out), "not a folder"])


def top_k_zero_hard(finished: Path, tmp: Path) -> Row:
    return Row(nmt.main, ["--variant", "hard", "--top-k", "0", "--no-progress", "--out", str(tmp / "nmt")], [tmp], ["top_k", "0"])


def top_k_zero_wc(finished: Path, tmp: Path) -> Row:
    return Row(nmt.main, ["--variant", "wc", "--top-k", "0", "--no-progress", "--out", str(tmp / "nmt")], [tmp], ["top_k", "0"])


def data_root_for_vqa(finished: Path, tmp: Path) -> Row:
    return Row(vqa.main, ["--data-root", "/nonexistent", "--no-progress", "--out", str(tmp / "vqa")], [tmp], ["--data-root"])


def _analysis_into_a_file(main: Callable[[Sequence[str]], object], argv: list[str]) -> Callable[[Path, Path], Row]:
    """An analysis command of finished runs whose ``--out`` is a file: refused before any run is read."""

    def fault(finished: Path, tmp: Path) -> Row:
        out = tmp / "results.txt"
        out.write_text("not a folder\n")
        run = str(finished / "runs" / RUN)
        return Row(main, [*(a.replace("RUN", run).replace("FOLDER", str(finished)) for a in argv), "--out", str(out)],
                   [finished, out], ["--out", str(out), "not a folder"])

    fault.__name__ = f"{main.__module__.split('.')[-1]}_into_a_file"
    return fault


FAULTS = [damaged_checkpoint_of_an_unfinished_run, damaged_checkpoint_of_a_finished_run, damaged_record,
          record_of_another_shape, out_is_a_file, out_under_a_file, out_unwritable, unfinished_run_with_other_settings,
          finished_run_with_other_settings, merge_of_one_run_with_other_settings, collect_into_a_file,
          top_k_zero_hard, top_k_zero_wc, data_root_for_vqa,
          _analysis_into_a_file(curves.main, ["FOLDER"]), _analysis_into_a_file(nmt_search.main, ["RUN"]),
          _analysis_into_a_file(nmt_uncertainty.main, ["RUN"])]


def snapshot(paths: Sequence[Path]) -> dict[str, Optional[str]]:
    """Every file and folder under ``paths``: a file's content checksum, None for a folder."""
    found: dict[str, Optional[str]] = {}
    for root in paths:
        for path in [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]:
            if path.exists():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return found


@contextmanager
def unprivileged(folder: Path) -> Iterator[None]:
    """``folder`` made read-only, and this process acting as user nobody while the block runs:
    root ignores permissions, so chmod alone does not stop it (the effective user id is what the
    kernel checks; root may take it back after)."""
    os.chmod(folder, 0o555)
    acting = os.geteuid() == 0
    if acting:
        os.seteuid(NOBODY)
    try:
        yield
    finally:
        if acting:
            os.seteuid(0)
        os.chmod(folder, 0o755)


def _no_data(*args, **kwargs):
    raise AssertionError("the data were loaded before the fault was found")


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_a_fault_ends_with_one_line_status_2_and_the_folder_untouched(fault, finished, monkeypatch, capsys):
    for module, loader in ((gat, "load_planetoid"), (nmt, "load_multi30k"), (vqa, "load_easy_vqa")):
        monkeypatch.setattr(module, loader, _no_data)
    with tempfile.TemporaryDirectory(prefix="bam-faults-") as tmp:  # under /tmp: reachable by nobody
        os.chmod(tmp, 0o755)
        row = fault(finished, Path(tmp))
        before = snapshot(row.watched)
        capsys.readouterr()
        with unprivileged(row.watched[0]) if row.unprivileged else nullcontext():
            with pytest.raises(SystemExit) as exit_info:
                row.main(row.argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert all(word in err for word in row.words), (row.words, err)
        assert snapshot(row.watched) == before


def test_load_trained_finds_a_damaged_checkpoint_before_the_data_load(finished, tmp_path, monkeypatch):
    monkeypatch.setattr(gat, "load_planetoid", _no_data)
    out = _copy(finished, tmp_path)
    _damage(out / "runs" / RUN / "checkpoint.pt", "flip")
    with pytest.raises(DamagedFile, match="checkpoint.pt is damaged \\(its checksum differs .*\\): delete that run's folder"):
        load_trained(gat.TASK, out / "runs" / RUN)
