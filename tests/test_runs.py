"""Run folders: a sweep resumes and never passes one setting's result off as another's; shards
merge into one table with paired differences."""

import multiprocessing
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.tables import mean_interval, paired_difference
from experiments.collect import main as collect_main
from experiments.gat import settings_for
from experiments.glue import settings_for as glue_settings
from experiments.runs import ResultsFile


def test_finished_run_is_found_again_after_a_restart(tmp_path):
    settings = settings_for("cora", "wc", 0, {}).row()
    results = ResultsFile(tmp_path, ("dataset", "variant", "seed"))
    assert not results.has(settings)
    results.add({**settings, "test_acc": 80.0})
    reopened = ResultsFile(tmp_path, ("dataset", "variant", "seed"))  # read back from the CSV
    assert reopened.has(settings)
    assert not reopened.has(settings_for("cora", "wc", 1, {}).row())


def test_two_writers_of_one_folder_keep_each_others_rows(tmp_path):
    first, second = (ResultsFile(tmp_path, ("dataset", "variant", "seed")) for _ in range(2))
    first.add({**settings_for("cora", "wc", 0, {}).row(), "test_acc": 80.0})
    assert second.has(settings_for("cora", "wc", 0, {}).row())  # sees the other process's run
    second.add({**settings_for("cora", "wc", 1, {}).row(), "test_acc": 81.0})
    assert sorted(pd.read_csv(tmp_path / "results.csv").seed) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".results.csv.lock", "results.csv"]  # no partial file


def _add_rows(out: Path, seeds: range) -> None:
    results = ResultsFile(out, ("dataset", "variant", "seed"))
    for seed in seeds:
        results.add({**settings_for("cora", "wc", seed, {}).row(), "test_acc": 80.0})


def test_writers_adding_at_the_same_time_lose_no_row(tmp_path):
    """Without the lock, two processes that read the same old file each write it back with only
    their own new row, and one row is lost."""
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_add_rows, args=(tmp_path, range(start, start + 30))) for start in (0, 100)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert len(pd.read_csv(tmp_path / "results.csv")) == 60


def test_same_run_with_other_settings_is_refused_by_name(tmp_path):
    ResultsFile(tmp_path, ("dataset", "variant", "seed")).add({**settings_for("cora", "wc", 0, {}).row(), "test_acc": 80.0})
    reopened = ResultsFile(tmp_path, ("dataset", "variant", "seed"))
    for override, field in (({"k": 10.0}, "k="), ({"detach_prior_keys": True}, "detach_prior_keys="), ({"patience": 5}, "patience=")):
        with pytest.raises(ValueError, match=field):
            reopened.has(settings_for("cora", "wc", 0, override).row())


def test_a_setting_the_folder_never_recorded_is_refused_as_unrecorded(tmp_path):
    """Rows written before a setting existed read back blank in its column; such a run may have
    used another value, so it is not taken as finished."""
    old_row = {k: v for k, v in settings_for("cora", "wc", 0, {}).row().items() if k != "dropout_per_head"}
    results = ResultsFile(tmp_path, ("dataset", "variant", "seed"))
    results.add({**old_row, "test_acc": 80.0})
    with pytest.raises(ValueError, match="dropout_per_head=not recorded"):  # no column for it at all
        results.has(settings_for("cora", "wc", 0, {}).row())
    results.add({**settings_for("cora", "wc", 1, {}).row(), "test_acc": 81.0})  # adds the column, blank above
    assert results.has(settings_for("cora", "wc", 1, {}).row())
    with pytest.raises(ValueError, match="dropout_per_head=None"):  # the old row's cell is blank now
        results.has(settings_for("cora", "wc", 0, {}).row())


def test_checkpoint_name_changes_with_any_setting(tmp_path):
    results = ResultsFile(tmp_path, ("dataset", "variant", "seed"))
    preset = results.checkpoint(settings_for("cora", "wc", 0, {}).row())
    assert preset == results.checkpoint(settings_for("cora", "wc", 0, {}).row())
    assert preset.name.startswith("cora-wc-0-") and preset.parent == tmp_path / "checkpoints"
    assert preset != results.checkpoint(settings_for("cora", "wc", 0, {"beta": 1e-9}).row())


def test_paired_difference_pairs_runs_by_seed():
    results = pd.DataFrame(dict(
        task=["a"] * 5 + ["b"] * 2, variant=["soft", "wc", "soft", "wc", "wc", "soft", "wc"],
        seed=[0, 0, 1, 1, 2, 0, 0], score=[1.0, 2.0, 3.0, 3.5, 9.0, 5.0, 4.0]))
    table = paired_difference(results, ["task"], "score")
    assert table.loc[("a", "wc"), "n"] == 2  # seed 2 has no soft run to pair with
    # (1.0 + 0.5) / 2, std of (1.0, 0.5); the interval is 0.75 -+ t(0.975, 1) * 0.354 / sqrt(2), t = 12.706
    assert table.loc[("a", "wc"), "score"] == "+0.75 ± 0.35, 95% CI [-2.43, +3.93]"
    assert table.loc[("b", "wc"), "score"] == "-1.00"  # one pair: no spread, no interval to show
    same = pd.DataFrame(dict(task="c", variant=["soft", "wc"] * 3, seed=[0, 0, 1, 1, 2, 2],
                             score=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    assert paired_difference(same, ["task"], "score").loc[("c", "wc"), "score"] == "+1.00 ± 0.00, 95% CI [+1.00, +1.00]"


def test_paired_interval_covers_the_true_difference_at_its_stated_rate():
    rng = np.random.default_rng(0)
    trials = 4000
    differences = rng.normal(loc=0.3, scale=1.0, size=(trials, 5))  # 5 seeds, true mean 0.3
    bounds = np.array([mean_interval(pd.Series(row)) for row in differences])
    covered = (bounds[:, 0] <= 0.3) & (0.3 <= bounds[:, 1])
    assert abs(covered.mean() - 0.95) < 0.015  # a normal quantile (1.96) in place of t(4) covers ~0.88


def test_collect_merges_shards_later_folder_wins(tmp_path):
    def shard(name, rows):
        ResultsFile(tmp_path / name, ("dataset", "variant", "seed"))  # creates the folder
        pd.DataFrame(rows).to_csv(tmp_path / name / "results.csv", index=False)
        return str(tmp_path / name)

    run = dict(dataset="cora", val_acc=80.0)
    first = shard("soft", [dict(run, variant="soft", seed=s, test_acc=80.0 + s) for s in (0, 1)])
    second = shard("wc", [dict(run, variant="wc", seed=s, test_acc=81.0 + s) for s in (0, 1)]
                   + [dict(run, variant="soft", seed=1, test_acc=82.0)])
    table = collect_main(["gat", first, second, "--out", str(tmp_path / "all")])
    merged = pd.read_csv(tmp_path / "all" / "results.csv")
    assert len(merged) == 4 and merged.query("variant == 'soft' and seed == 1").test_acc.item() == 82.0
    assert table.loc[("cora", "wc"), "test_acc - soft (paired)"] == "+0.50 ± 0.71, 95% CI [-5.85, +6.85]"  # seed 0: 81 - 80, seed 1: 82 - 82 (the later soft row)
    assert (tmp_path / "all" / "paired.png").stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="no results.csv"):
        collect_main(["gat", str(tmp_path / "missing"), "--out", str(tmp_path / "x")])


def test_collect_refuses_to_average_different_settings(tmp_path):
    for name, k in (("a", 1.0), ("b", 10.0)):
        (tmp_path / name).mkdir()
        pd.DataFrame([dict(dataset="cora", variant="wc", seed=int(k), k=k, test_acc=80.0, val_acc=80.0)]).to_csv(
            tmp_path / name / "results.csv", index=False)
    with pytest.raises(ValueError, match=r"cora/wc runs differ in their settings \{'k'"):
        collect_main(["gat", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "all")])


def test_collect_names_folders_whose_file_predates_a_setting(tmp_path, caplog):
    files = {"old": [dict(seed=0, d_mid=1)],  # no rho column: written before rho was recorded
             "new": [dict(seed=1, d_mid=1.0, rho=0.1)],  # 1.0 is the same setting as 1
             "none": [dict(seed=2, d_mid=1, rho=None)]}  # a blank cell is a recorded None
    for name, runs in files.items():
        (tmp_path / name).mkdir()
        pd.DataFrame([dict(dataset="cora", variant="wc", test_acc=80.0, val_acc=80.0, **r) for r in runs]).to_csv(
            tmp_path / name / "results.csv", index=False)
    with caplog.at_level("WARNING"):
        collect_main(["gat", str(tmp_path / "old"), str(tmp_path / "new"), "--out", str(tmp_path / "all")])
    assert f"{tmp_path / 'old'} does not record rho" in caplog.text
    assert "new does not record" not in caplog.text
    with pytest.raises(ValueError, match=r"differ in their settings \{'rho': \['0.1', 'nan'\]"):
        collect_main(["gat", str(tmp_path / "new"), str(tmp_path / "none"), "--out", str(tmp_path / "all")])


def test_collect_compare_keeps_each_setting_apart(tmp_path):
    rows = {"a": [dict(k=1.0, seed=s, val_acc=80.0 + s) for s in (0, 1)],
            "b": [dict(k=10.0, seed=0, val_acc=70.0), dict(k=10.0, seed=0, val_acc=72.0)],  # a rerun: last wins
            "c": [dict(k=None, seed=0, val_acc=60.0)],  # a blank cell: k recorded as None
            "d": [dict(seed=0, val_acc=50.0)]}  # a file from before k was recorded
    for name, runs in rows.items():
        (tmp_path / name).mkdir()
        pd.DataFrame([dict(dataset="cora", variant="wc", beta=1e-10, test_acc=1.0, **r) for r in runs]).to_csv(
            tmp_path / name / "results.csv", index=False)
    table = collect_main(["gat", *(str(tmp_path / n) for n in rows), "--out", str(tmp_path / "all"), "--compare"])
    assert list(table.columns) == ["dataset", "variant", "k", "n", "val_acc", "test_acc"]  # beta is the same throughout
    by_k = table.set_index("k")
    assert by_k.loc[1.0, "val_acc"] == "80.50 ± 0.71" and by_k.loc[1.0, "n"] == 2
    assert by_k.loc[10.0, "val_acc"] == "72.00"
    assert by_k.loc["None", "val_acc"] == "60.00"
    assert by_k.loc["(not recorded)", "val_acc"] == "50.00"
    assert not (tmp_path / "all" / "paired.png").exists()


def test_collect_refuses_to_pair_variants_trained_differently(tmp_path):
    def folder(name, rows):
        (tmp_path / name).mkdir()
        pd.DataFrame([dict(row, test_acc=80.0, val_acc=80.0, dev_accuracy=60.0) for row in rows]).to_csv(
            tmp_path / name / "results.csv", index=False)
        return str(tmp_path / name)

    short = folder("short", [settings_for("cora", "soft", 0, {"max_epochs": 5}).row()])
    soft = folder("soft", [settings_for("cora", "soft", 0, {}).row()])
    wc = folder("wc", [settings_for("cora", "wc", 0, {}).row()])
    with pytest.raises(ValueError, match=r"the cora runs differ in their settings \{'max_epochs': \['1000', '5'\]\}: "
                                         r"variants are paired by seed only if trained alike"):
        collect_main(["gat", short, wc, "--out", str(tmp_path / "all")])
    # the presets: soft and wc differ in their attention's settings (k, beta, rho, ...) only
    assert collect_main(["gat", soft, wc, "--out", str(tmp_path / "all")]).loc[("cora", "wc"), "n"] == 1
    glue_runs = folder("glue", [glue_settings("rte", "soft", 0, "m", {"epochs": 1}).row(),
                                glue_settings("rte", "wc", 0, "m", {"k": 10.0}).row()])
    with pytest.raises(ValueError, match=r"the rte runs differ in their settings \{'epochs': \['1', '3'\]\}"):
        collect_main(["glue", glue_runs, "--out", str(tmp_path / "all")])
