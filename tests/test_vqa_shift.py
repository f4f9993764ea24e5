"""The image shift of VQA (clean against noisy grid features): the draws saved by
``python -m experiments.vqa.ood`` on tiny runs trained here, and the tables and figures drawn from
them, built twice by ``experiments.results`` to the same bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import experiments.results
from experiments.records import RunFolder
from experiments.results import load_results
from experiments.runner import load_trained
from experiments.runner.shift_draws import SHIFT_FILE
from experiments.runner.shift_tables import METHODS
from experiments.vqa import ood
from experiments.vqa.published import SHIFT
from experiments.vqa.shift_tables import evaluation_sets, shift_tables
from experiments.vqa.task import TASK
from experiments.vqa.task import main as vqa
from experiments.vqa.uncertainty import feature_noise, grid_features, noisy, uncertainty_rows

#: a tiny MCAN on 12 training and 6 test images (about 60 test questions), one epoch: seconds a run;
#: k = 10, not the preset's 1000, so that BAM's attention noise shows in float32
TINY = ["--hidden", "16", "--heads", "2", "--encoder-layers", "1", "--decoder-layers", "1", "--features", "16",
        "--batch-size", "64", "--eval-batch", "64", "--train-images", "12", "--test-images", "6", "--max-epochs", "1",
        "--chains", "0", "--samples", "0", "--noise-sweep", "1", "--uncertainty-questions", "30", "--k", "10",
        "--threads", "1", "--no-progress"]
QUESTIONS = 30
SETS = ("id", "noise1", "noise5")  # the sweep's variance 1 and the noisy data's 5, the task's default
RUNS = [*(f"easy-vqa-soft-seed{k}" for k in range(5)), "easy-vqa-wc-seed0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Soft seeds 0-4 (one ensemble) and BAM-WC seed 0, with their shift.npz: their output folder."""
    out = tmp_path_factory.mktemp("vqa-shift")
    vqa(["--variant", "soft", "--seeds", "0", "1", "2", "3", "4", "--out", str(out), *TINY])
    vqa(["--variant", "wc", "--seeds", "0", "--out", str(out), *TINY])
    runs = [RunFolder(out).run_dir(name) for name in RUNS]
    assert ood.main([*map(str, runs), "--draws", "3"]) == [run / SHIFT_FILE for run in runs]
    return out


def arrays_of(trained: Path, run: str) -> dict[str, np.ndarray]:
    return dict(np.load(RunFolder(trained).run_dir(run) / SHIFT_FILE))


@pytest.mark.parametrize("run", ["easy-vqa-soft-seed0", "easy-vqa-wc-seed0"])
def test_the_script_saves_every_noise_level_and_mode_with_labels(trained, run):
    arrays = arrays_of(trained, run)
    settings, data, _ = load_trained(TASK, RunFolder(trained).run_dir(run))
    modes = ["mc_dropout"] if "soft" in run else ["attention", "attention_dropout"]
    expected = {f"{s}.labels" for s in SETS} | {f"{s}.{m}.{part}" for s in SETS for m in modes for part in ("probs", "mutual_info")}
    if "soft" in run:
        expected |= {"val.logits", "val.labels", *(f"{s}.logits" for s in SETS)}
    assert set(arrays) == expected
    rows = uncertainty_rows(data.test, settings.uncertainty_questions, settings.split_seed)
    assert len(rows) == QUESTIONS
    for s in SETS:  # the run's own uncertainty questions, their answers kept under noise
        assert arrays[f"{s}.labels"].tolist() == data.test.answers[rows].tolist()
        for mode in modes:
            probs = arrays[f"{s}.{mode}.probs"]
            assert probs.shape == (QUESTIONS, len(data.answers)) and probs.dtype == np.float16
            assert np.allclose(probs.astype(np.float64).sum(-1), 1, atol=1e-2)
            assert arrays[f"{s}.{mode}.mutual_info"].dtype == np.float32 and (arrays[f"{s}.{mode}.mutual_info"] >= 0).all()
            assert arrays[f"{s}.{mode}.mutual_info"].max() > 0  # draws that differ: dropout, or attention noise at k = 10
    if "soft" in run:  # every validation question: fewer than VAL_QUESTIONS here
        assert arrays["val.labels"].tolist() == data.val.answers.tolist() and len(data.val) < ood.VAL_QUESTIONS
    assert not list(RunFolder(trained).run_dir(run).glob(".shift-*"))  # staged write: no partial file left


def test_noisy_sets_are_the_tasks_feature_noise_at_each_variance(trained):
    """A soft run's saved logits of each set are its network's on the clean grid features plus
    sqrt(variance) times the task's seeded noise."""
    settings, data, model = load_trained(TASK, RunFolder(trained).run_dir("easy-vqa-soft-seed0"))
    arrays = arrays_of(trained, "easy-vqa-soft-seed0")
    rows = uncertainty_rows(data.test, settings.uncertainty_questions, settings.split_seed)[:4]
    clean = grid_features(model, data.test, settings.eval_batch)
    noise = feature_noise(clean.shape, settings.noise_seed)
    with torch.no_grad():
        for name, variance in zip(SETS, (0.0, 1.0, 5.0)):
            features = noisy(clean, noise, variance)[data.test.image_index[rows]]
            logits = model.network(data.test.question_words(rows), features=features).numpy()
            np.testing.assert_allclose(arrays[f"{name}.logits"][:4].astype(np.float64), logits, atol=2e-2)
    assert not np.array_equal(arrays["id.logits"], arrays["noise5.logits"])


def test_the_tables_score_every_method_on_every_noise_level(trained):
    results = load_results(TASK, trained)
    assert [s.label for s in evaluation_sets(results)] == ["ID", "var=1", "var=5"]
    tables = shift_tables(results, RunFolder(trained))
    detection = tables["detection"]
    assert list(dict.fromkeys(detection["method"])) == [m for m in METHODS if "LC" not in m]
    assert set(detection["n"]) == {1}  # seed 0: the one seed with an ensemble of 5 soft runs
    assert [c for c in detection if c.startswith(("AUROC", "FPR95", "AURC"))] == [
        "AURC ID", "AUROC var=1", "FPR95 var=1", "AURC var=1", "AUROC var=5", "FPR95 var=5", "AURC var=5"]
    calibration = tables["calibration"]
    assert [c for c in calibration if c.startswith(("acc", "ECE"))] == [
        "acc ID", "ECE ID", "acc var=1", "ECE var=1", "acc var=5", "ECE var=5"]
    paired = tables["paired"]
    assert len(paired) == 2 * 3 and list(paired.columns[4:]) == ["AUROC var=1", "AUROC var=5", "AURC var=5"]


def test_noisy_questions_as_confident_as_clean_ones_are_not_detected(trained, tmp_path):
    """BAM-WC's noisy copies at variance 5 given the clean ones' predictions: every score ties
    item by item, AUROC 50 exactly; variance 1 and the other methods keep their figures."""
    folder = tmp_path / "vqa-shift"
    shutil.copytree(trained, folder)
    before = shift_tables(load_results(TASK, folder), RunFolder(folder))["detection"]
    path = RunFolder(folder).run_dir("easy-vqa-wc-seed0") / SHIFT_FILE
    arrays = dict(np.load(path))
    for part in ("probs", "mutual_info"):
        arrays[f"noise5.attention.{part}"] = arrays[f"id.attention.{part}"]
    np.savez(path, **arrays)
    after = shift_tables(load_results(TASK, folder), RunFolder(folder))["detection"]
    chosen = (after["method"] == "BAM-WC").to_numpy()
    assert (after.loc[chosen, "AUROC var=5"] == "50.00").all()  # one seed: no std
    assert after.loc[chosen, "AUROC var=1"].tolist() == before.loc[chosen, "AUROC var=1"].tolist()
    assert after.loc[~chosen, "AUROC var=5"].tolist() == before.loc[~chosen, "AUROC var=5"].tolist()


def test_results_publish_the_same_bytes_from_the_same_records(trained, tmp_path, monkeypatch):
    """``python -m experiments.results vqa --add vqa-shift=FOLDER`` with the shift tables published:
    the records and shift.npz copied, three tables and two figures per noise level drawn; drawn
    again from the copied records, every file is byte for byte the same."""
    monkeypatch.setitem(experiments.results.PUBLISHED, "vqa", SHIFT)
    records, first, second = tmp_path / "results", tmp_path / "first", tmp_path / "second"
    written = experiments.results.main(["vqa", "--records", str(records), "--out", str(first), "--add", f"vqa-shift={trained}"])
    figures = [f"vqa_shift_{kind}_{level}_easy-vqa.png" for kind in ("reliability", "risk_coverage") for level in SETS[1:]]
    tables = ["vqa_shift_calibration.md", "vqa_shift_detection.md", "vqa_shift_paired.md"]
    assert sorted(p.name for p in written) == sorted([*tables, *figures])
    assert sorted(p.name for p in (records / "vqa-shift" / "runs" / RUNS[0]).iterdir()) == ["record.json", SHIFT_FILE]
    again = experiments.results.build("vqa", records, second)
    assert [p.name for p in again] == [p.name for p in written]
    for path in written:
        assert (second / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("options, message", [
    (["--draws", "1"], "--draws must be at least 2"),
    (["--data-root", "/data"], "--data-root is not read: the data come from the easy-vqa package"),
])
def test_bad_options_end_the_command_with_one_line(options, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as ended:
        ood.main([str(tmp_path), *options])
    assert ended.value.code == 2 and message in capsys.readouterr().err


def test_a_folder_that_is_no_finished_run_is_one_line_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as ended:
        ood.main([str(tmp_path / "runs" / "easy-vqa-soft-seed0")])
    message = capsys.readouterr().err
    assert ended.value.code == 2 and message.count("\n") == 1 and "not a run folder" in message
