"""The runner and its records: options from settings fields, skip and refuse, one-line user errors,
merging folders, paired tables with the paper's figures, and a real CLI run killed mid-epoch that resumes exactly."""

import dataclasses
import json
import multiprocessing
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.tables import mean_interval, paired_difference, summarize
from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.training import Diverged
from experiments.gat import task as gat
from experiments.collect import main as collect_main
from experiments.records import RunFolder, SettingsMismatch, new_record
from experiments.runner import ATTENTION_FIELDS, OBJECTIVE_FIELDS, RunSettings, Task, build_parser, paired_table, run_cli

REPO = Path(__file__).resolve().parents[1]


def test_run_settings_cover_every_library_setting_with_its_default():
    """A field added to BamConfig or ObjectiveConfig must reach every task's options and records."""
    fields = {f.name: f.default for f in dataclasses.fields(RunSettings)}
    for config in (BamConfig, ObjectiveConfig):
        for f in dataclasses.fields(config):
            if f.name != "variant":
                assert fields[f.name] == f.default, f.name
    settings = RunSettings(variant="wc", k=3.0, anneal_rate=0.5)
    assert settings.attention == BamConfig("wc", k=3.0) and settings.objective == ObjectiveConfig(anneal_rate=0.5)
    assert RunSettings(variant="exact").attention.variant == "soft"  # a task's own variant: soft attention
    assert set(ATTENTION_FIELDS) | set(OBJECTIVE_FIELDS) <= set(settings.row())


@dataclasses.dataclass(frozen=True)
class ToySettings(RunSettings):
    dataset: str = "a"
    lr: float = 0.1
    steps: int = 3
    mode: Literal["x", "y"] = "x"
    cap: Optional[int] = None
    flag: bool = True


def toy_train(settings, data, run):
    return {"score": data + settings.lr * settings.steps + 0.01 * settings.seed + (settings.variant == "wc") * settings.k / 2.5}


TOY = Task(name="toy", settings=ToySettings, panel="dataset", panels=("a", "b"), load=lambda s, root: 1.0,
           train=toy_train, metrics=("score",), presets=lambda panel, variant: {"k": 3.0} if variant == "wc" else {})


def test_options_come_from_the_settings_fields():
    parser, names = build_parser(TOY)
    args = parser.parse_args(["--lr", "0.5", "--mode", "y", "--cap", "4", "--no-flag", "--rho", "0.2", "--att-kl", "3"])
    assert (args.lr, args.mode, args.cap, args.flag, args.anneal_rate, args.kl_weight) == (0.5, "y", 4, False, 0.2, 3.0)
    assert args.steps is None  # not given: the preset or the default holds
    assert {"lr", "steps", "mode", "cap", "flag", "k", "detach_prior_keys"} <= set(names)
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "z"])


def test_sweep_records_tables_skips_and_refuses_by_name(tmp_path, capsys):
    out = str(tmp_path / "toy")
    tables = run_cli(TOY, ["--dataset", "a", "b", "--variant", "soft", "wc", "--seeds", "0", "1", "--out", out])
    table = tables["results"].set_index(["dataset", "variant"])
    assert table.loc[("a", "wc"), "score - soft (paired)"] == "+1.20 ± 0.00, 95% CI [+1.20, +1.20]"  # preset k=3
    record = json.loads((tmp_path / "toy" / "runs" / "b-wc-seed1" / "record.json").read_text())
    assert record["settings"]["k"] == 3.0 and record["metrics"]["score"] == pytest.approx(2.51)
    assert record["environment"] == {"accelerator": "cpu", "devices": ["cpu"], "processes": 1, "num_nodes": 1,
                                     "strategy": "single process", "precision": "32-true",
                                     "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    assert len(pd.read_csv(tmp_path / "toy" / "results.csv")) == 8
    assert {"table.md", "table-results.csv", "paired.png"} <= {p.name for p in (tmp_path / "toy").iterdir()}
    capsys.readouterr()
    run_cli(TOY, ["--dataset", "a", "--variant", "wc", "--seeds", "1", "--out", out])  # finished: skipped
    assert "a wc seed 1" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        run_cli(TOY, ["--dataset", "a", "--variant", "wc", "--seeds", "1", "--out", out, "--lr", "0.2"])
    assert exit_info.value.code == 2
    assert "holds a finished run with other settings: lr=0.1 (asked for 0.2)" in capsys.readouterr().err


def test_a_sweep_refuses_runs_its_folder_would_pool_or_pair_with_runs_trained_otherwise(tmp_path, capsys):
    """New seeds or variants go into a folder only if its table stays one experiment: the seeds of
    a variant alike in every setting, the variants of a panel alike in all but their attention's."""
    out = str(tmp_path / "toy")
    run_cli(TOY, ["--dataset", "a", "--variant", "soft", "wc", "--seeds", "0", "1", "--out", out])
    refusals = ((["--variant", "soft", "wc", "--seeds", "2", "--lr", "0.5"],
                 "a-soft-seed0 (RECORD) and a-soft-seed2 (asked for) differ in lr=0.1 / 0.5: they are not seeds of one experiment"),
                (["--variant", "lf", "--seeds", "0", "--steps", "7"],
                 "a-soft-seed0 (RECORD) and a-lf-seed0 (asked for) differ in steps=3 / 7: variants are paired by seed only if trained alike"))
    for args, message in refusals:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(TOY, ["--dataset", "a", *args, "--out", out])
        err = capsys.readouterr().err
        message = message.replace("RECORD", str(Path(out, "runs", "a-soft-seed0", "record.json")))
        assert exit_info.value.code == 2 and message in err and "choose another --out" in err, err
    assert len(pd.read_csv(tmp_path / "toy" / "results.csv")) == 4  # nothing was trained
    # a variant of its own attention settings, trained alike, joins the panel
    run_cli(TOY, ["--dataset", "a", "--variant", "lf", "--seeds", "0", "1", "--k", "3", "--out", out])
    assert len(pd.read_csv(tmp_path / "toy" / "results.csv")) == 6


def test_a_record_that_lacks_a_setting_is_not_taken_as_finished(tmp_path):
    folder = RunFolder(tmp_path)
    settings = ToySettings(variant="wc").row()
    older = {k: v for k, v in settings.items() if k != "flag"}
    folder.save("a-wc-seed0", new_record("toy", older, {"score": 1.0}, None, 1.0))
    with pytest.raises(SettingsMismatch, match="flag=not recorded"):
        folder.finished("a-wc-seed0", "toy", settings)
    assert not folder.finished("a-wc-seed1", "toy", settings)


def _finish_runs(out: Path, seeds: range) -> None:
    folder = RunFolder(out)
    for seed in seeds:
        folder.save(f"a-wc-seed{seed}", new_record("toy", ToySettings(variant="wc", seed=seed).row(), {"score": 1.0}, None, 0.0))
        folder.write_results()


def test_processes_finishing_at_once_lose_no_run(tmp_path):
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_finish_runs, args=(tmp_path, range(start, start + 20))) for start in (0, 100)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert len(pd.read_csv(tmp_path / "results.csv")) == 40
    assert not list(tmp_path.glob(".results-*")) and not list(tmp_path.glob("runs/*/.record*"))


def test_a_run_another_process_is_training_is_left_to_it(tmp_path, capsys):
    folder = RunFolder(tmp_path)
    with folder.claimed("a-wc-seed0") as ours:  # a second open of the lock file, as another process's
        assert ours
        with folder.claimed("a-wc-seed0") as theirs:
            assert not theirs
        run_cli(TOY, ["--dataset", "a", "--variant", "soft", "wc", "--seeds", "0", "--out", str(tmp_path)])
        assert "a-wc-seed0: being trained by another process" in capsys.readouterr().out
        assert folder.record("a-wc-seed0") is None and folder.record("a-soft-seed0") is not None
    run_cli(TOY, ["--dataset", "a", "--variant", "soft", "wc", "--seeds", "0", "--out", str(tmp_path)])  # released
    assert folder.record("a-wc-seed0")["metrics"]["score"] == pytest.approx(2.5)


def test_a_run_that_diverges_is_said_in_one_line_and_the_sweep_goes_on(tmp_path, capsys):
    def diverges_at_seed_0(settings, data, run):
        if settings.variant == "wc" and settings.seed == 0:
            raise Diverged("non-finite loss nan at step 8; check the inputs")
        return toy_train(settings, data, run)

    out = tmp_path / "toy"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(dataclasses.replace(TOY, train=diverges_at_seed_0),
                ["--dataset", "a", "--variant", "soft", "wc", "--seeds", "0", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 1 and captured.err.count("\n") == 1, captured.err
    assert "1 run(s) diverged and have no record: a-wc-seed0" in captured.err
    assert "a-wc-seed0: diverged, not recorded: non-finite loss nan at step 8" in captured.out
    folder = RunFolder(out)
    assert folder.record("a-wc-seed0") is None
    assert all(folder.record(name) is not None for name in ("a-soft-seed0", "a-soft-seed1", "a-wc-seed1"))  # after it too
    assert sorted(pd.read_csv(out / "results.csv")["seed"]) == [0, 1, 1]  # tabulated without it
    run_cli(TOY, ["--dataset", "a", "--variant", "soft", "wc", "--seeds", "0", "1", "--out", str(out)])  # retried alone
    assert folder.record("a-wc-seed0")["metrics"]["score"] == pytest.approx(2.5)


def test_user_errors_end_with_one_line_and_status_2(tmp_path, capsys):
    for args, message in ((["--lr", "-1"], "lr must be a finite number > 0, got -1.0"),
                          (["--samples", "1"], "samples must be 0 or at least 2"),
                          ([], "Planetoid Cora: missing ind.cora.x")):
        with pytest.raises(SystemExit) as exit_info:
            gat.main([*args, "--data-root", str(tmp_path), "--out", str(tmp_path / "g")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without the accelerator asked for")
def test_an_accelerator_this_machine_lacks_ends_with_one_line_and_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(TOY, ["--accelerator", "mps", "--out", str(tmp_path / "toy")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "MPSAccelerator` can not run on your system" in err, err
    assert not (tmp_path / "toy" / "runs").exists()


def test_paired_difference_pairs_runs_by_seed():
    results = pd.DataFrame(dict(
        task=["a"] * 5 + ["b"] * 2, variant=["soft", "wc", "soft", "wc", "wc", "soft", "wc"],
        seed=[0, 0, 1, 1, 2, 0, 0], score=[1.0, 2.0, 3.0, 3.5, 9.0, 5.0, 4.0]))
    table = paired_difference(results, ["task"], "score")
    assert table.loc[("a", "wc"), "n"] == 2  # seed 2 has no soft run to pair with
    # (1.0 + 0.5) / 2, std of (1.0, 0.5); the interval is 0.75 -+ t(0.975, 1) * 0.354 / sqrt(2), t = 12.706
    assert table.loc[("a", "wc"), "score"] == "+0.75 ± 0.35, 95% CI [-2.43, +3.93]"
    assert table.loc[("b", "wc"), "score"] == "-1.00"  # one pair: no spread, no interval to show


def test_summary_writes_counts_whole_and_measures_as_mean_and_std():
    results = pd.DataFrame(dict(variant=["soft", "soft", "wc"], parameters=[8911936, 8911936, 8914506],
                                epochs=[12, 14, 13], bleu=[41.0, 40.0, 41.26]))
    table = summarize(results, ["variant"], ["parameters", "epochs", "bleu"])
    assert table.loc["soft"].tolist() == [2, "8,911,936", "13.00 ± 1.41", "40.50 ± 0.71"]
    assert table.loc["wc"].tolist() == [1, "8,914,506", "13", "41.26"]


def test_paired_table_shows_the_papers_figures_of_the_metrics_it_gives():
    task = dataclasses.replace(TOY, metrics=("score", "speed", "size"),
                               paper={"a": {"soft": {"score": "1.50"}, "wc": {"score": "2.00 ± 0.1", "size": "42M"}}})
    results = pd.DataFrame(dict(dataset=["a", "a", "b"], variant=["wc", "soft", "wc"], seed=[0, 0, 0],
                                score=[2.0, 1.0, 3.0], speed=[0.6, 0.5, 0.7], size=[11, 10, 11]))
    table = paired_table(task, results)
    assert table.index.tolist() == [("a", "soft"), ("a", "wc"), ("b", "wc")]  # the task's order of variants    assert [c for c in table if c.startswith("paper")] == ["paper score", "paper size"]  # none given for speed
    assert table["paper score"].tolist() == ["1.50", "2.00 ± 0.1", ""]  # as the paper prints it; none for panel b
    assert table["paper size"].tolist() == ["", "42M", ""]


def test_paired_interval_covers_the_true_difference_at_its_stated_rate():
    rng = np.random.default_rng(0)
    differences = rng.normal(loc=0.3, scale=1.0, size=(4000, 5))  # 5 seeds, true mean 0.3
    bounds = np.array([mean_interval(pd.Series(row)) for row in differences])
    covered = (bounds[:, 0] <= 0.3) & (0.3 <= bounds[:, 1])
    assert abs(covered.mean() - 0.95) < 0.015  # a normal quantile (1.96) in place of t(4) covers ~0.88


def _gat_folder(path: Path, runs: list[tuple[str, int, dict, float]]) -> str:
    """An output folder of finished GAT runs (variant, seed, overrides, test accuracy)."""
    folder = RunFolder(path)
    for variant, seed, overrides, acc in runs:
        settings = gat.TASK.settings_for("cora", variant, seed, overrides)
        folder.save(gat.TASK.run_name(settings), new_record("gat", settings.row(), {"test_acc": acc, "val_acc": acc}, None, 1.0))
    return str(path)


def test_collect_merges_folders_later_folder_wins_and_refuses_mixed_settings(tmp_path, capsys):
    first = _gat_folder(tmp_path / "soft", [("soft", 0, {}, 80.0), ("soft", 1, {}, 81.0)])
    second = _gat_folder(tmp_path / "wc", [("wc", 0, {}, 81.0), ("wc", 1, {}, 83.0), ("soft", 1, {}, 82.0)])
    tables = collect_main([first, second, "--out", str(tmp_path / "all")])
    merged = pd.read_csv(tmp_path / "all" / "results.csv")
    assert len(merged) == 4 and merged.query("variant == 'soft' and seed == 1").test_acc.item() == 82.0
    accuracy = tables["accuracy"].set_index(["dataset", "variant"])
    assert accuracy.loc[("cora", "wc"), "test_acc - soft (paired)"] == "+1.00 ± 0.00, 95% CI [+1.00, +1.00]"
    assert (tmp_path / "all" / "paired.png").stat().st_size > 0

    other_k = _gat_folder(tmp_path / "k10", [("wc", 2, {"k": 10.0}, 84.0)])
    short = _gat_folder(tmp_path / "short", [("soft", 2, {"max_epochs": 5}, 70.0)])
    for folders, message in (([second, other_k], f"the cora/wc runs cora-wc-seed0 ({second}/runs/cora-wc-seed0/record.json) and "
                                                 f"cora-wc-seed2 ({other_k}/runs/cora-wc-seed2/record.json) differ in k=1.0 / 10.0"),
                             ([other_k, short], "differ in max_epochs=1000 / 5: variants are paired")):
        with pytest.raises(SystemExit):
            collect_main([*folders, "--out", str(tmp_path / "x")])
        assert message in capsys.readouterr().err
    table = collect_main([second, other_k, "--compare", "--out", str(tmp_path / "cmp")])["compare"]
    assert list(table.columns)[:3] == ["dataset", "variant", "k"] and len(table) == 3

    rerun = _gat_folder(tmp_path / "rerun", [("wc", 0, {"k": 10.0}, 90.0), ("wc", 1, {"k": 10.0}, 91.0)])
    with pytest.raises(SystemExit):  # the same runs with other settings: which to show is the user's to say
        collect_main([second, rerun, "--out", str(tmp_path / "x")])
    assert "run cora-wc-seed0 is in" in capsys.readouterr().err
    collect_main([second, rerun, "--later-wins", "--out", str(tmp_path / "rerun-paired")])
    merged = pd.read_csv(tmp_path / "rerun-paired" / "results.csv").query("variant == 'wc'")
    assert merged.k.tolist() == [10.0, 10.0] and merged.test_acc.tolist() == [90.0, 91.0]


def test_collect_names_a_folder_without_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        collect_main([str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
    assert "no finished runs in" in capsys.readouterr().err


def _glue_cli(out: Path, data_root: Path, model: Path, *extra: str) -> subprocess.Popen:
    args = ["--task", "rte", "--variant", "wc", "--seeds", "0", "--model", str(model), "--max-train", "160",
            "--batch-size", "4", "--max-length", "32", "--epochs", "2", "--draws", "0", "--threads", "1",
            "--no-progress", "--data-root", str(data_root), "--out", str(out), *extra]
    return subprocess.Popen([sys.executable, "-m", "experiments.glue", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_cli_run_killed_mid_epoch_resumes_to_the_uninterrupted_result(tmp_path, data_root, tiny_bert_folder):
    """SIGKILL after a checkpoint written inside the first epoch (every step: --checkpoint-minutes 0),
    then the same command again: the record equals that of a run never interrupted."""
    reference = _glue_cli(tmp_path / "reference", data_root, tiny_bert_folder)
    killed = _glue_cli(tmp_path / "killed", data_root, tiny_bert_folder, "--checkpoint-minutes", "0")
    checkpoint = tmp_path / "killed" / "runs" / "rte-wc-seed0" / "checkpoint.pt"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if checkpoint.exists():
            try:
                state = torch.load(checkpoint, weights_only=True)
            except (RuntimeError, EOFError):  # replaced while being read
                continue
            if state["epoch"] == 0 and state["step_in_epoch"] >= 5:
                break
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert state["epoch"] == 0 and 5 <= state["step_in_epoch"] < 40, "not killed inside the first epoch"
    resumed = _glue_cli(tmp_path / "killed", data_root, tiny_bert_folder, "--checkpoint-minutes", "0")
    assert resumed.wait() == 0 and reference.wait() == 0, resumed.stderr.read()
    records = [json.loads((tmp_path / f / "runs" / "rte-wc-seed0" / "record.json").read_text()) for f in ("reference", "killed")]
    assert records[1]["metrics"] == records[0]["metrics"]
    assert records[1]["training"]["history"] == records[0]["training"]["history"]


def test_a_record_names_the_commit_of_the_code_that_made_it(tmp_path):
    from experiments.records import SOURCE_COMMIT, source_commit, versions

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    assert source_commit(tmp_path) is None  # not a checkout
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "code.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert source_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files are not the code\n")
    assert source_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert source_commit(tmp_path) == head + "+changes"
    assert versions().get("bam-pyro commit") == SOURCE_COMMIT  # this checkout's, taken when the code was imported
