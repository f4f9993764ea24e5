"""The VQA task: a short real run learns, the feature noise touches test data only, and the tables,
figures and attention report are written."""

import json
import numpy as np
import pandas as pd
import pytest
import torch

import experiments.vqa.task
from analysis.vqa_figures import QuestionView, attention_picture, noise_sweep_figure, spotlight
from experiments.vqa.easy_vqa import load_easy_vqa
from experiments.runner import RunContext
from experiments.vqa.task import TASK, VqaSettings, presets, train, training_batches
from experiments.vqa.tables import tables
from experiments.vqa.uncertainty import condition_metrics, feature_noise

TINY = dict(hidden=32, heads=2, encoder_layers=1, decoder_layers=1, features=16, batch_size=64, lr=3e-3,
            chains=0, samples=0, noise_sweep="")


@pytest.fixture(scope="module")
def data():
    return load_easy_vqa(train_images=200, test_images=40)


@pytest.fixture(scope="module")
def few():
    """Enough questions to run every step of a run, not to learn."""
    return load_easy_vqa(train_images=30, test_images=10)


def context(folder, run_settings):
    return RunContext(folder, run_settings, progress=False)


def settings(variant="soft", **changes):
    return VqaSettings(variant=variant, **{**presets("easy-vqa", variant), **TINY, **changes})


def test_a_short_run_learns_well_above_the_majority_answer(data, tmp_path):
    """Two epochs on 1,500 questions (seconds) reach the level the question alone allows (67% on
    easy-VQA, mostly yes/no answers read off the question's template), far above always giving
    the majority answer; reading the images takes longer (see the README's run)."""
    majority = 100 * (data.test.answers == data.majority_answer).double().mean().item()
    chosen = settings(max_epochs=2)
    metrics = train(chosen, data, context(tmp_path, chosen))
    assert metrics["test_acc"] > majority + 15
    assert metrics["val_acc"] > majority + 15


def test_feature_noise_reaches_the_test_data_only(few, tmp_path, monkeypatch):
    """Training ignores the noise setting (the same parameters whatever its variance); scoring gets
    the clean grid features and the same features plus sqrt(variance) times the seeded noise."""
    scored = []

    def recording(model, split, features, condition, chosen, rows, engine):
        scored.append((condition, features))
        return condition_metrics(model, split, features, condition, chosen, rows, engine)

    monkeypatch.setattr(experiments.vqa.task, "condition_metrics", recording)
    states = []
    for variance in (5.0, 1e4):
        chosen = settings("wc", max_epochs=1, noise_variance=variance)
        run = context(tmp_path / f"variance-{variance:g}", chosen)
        train(chosen, few, run)
        states.append(run.trainers[0].model.state_dict())
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    (_, clean), (_, noisy_5), (_, clean_again), (_, noisy_big) = scored
    assert [c for c, _ in scored] == ["clean", "noisy"] * 2 and torch.equal(clean, clean_again)
    noise = feature_noise(clean.shape, seed=0)
    torch.testing.assert_close(noisy_5 - clean, 5 ** 0.5 * noise)
    torch.testing.assert_close(noisy_big - clean, 100 * noise)
    args, targets = next(training_batches(few.train, 8, np.random.default_rng(0)))
    assert args[1].dtype == torch.uint8 and set(targets) == {"answers"}  # raw images: nothing added


def test_uncertainty_sweep_and_attention_report(few, tmp_path):
    chosen = settings("wc", max_epochs=1, samples=3, chunk=100, chains=2, diag_questions=3, diag_draws=100,
                      noise_sweep="1", uncertainty_questions=40, k=10.0)  # k = 1000 (the preset): too few distinct floats
    metrics = train(chosen, few, context(tmp_path, chosen))
    for condition in ("clean", "noisy"):
        for mode in ("full", "attention"):
            assert 0 <= metrics[f"{condition}.{mode}.pavpu@0.05"] <= 100
            assert metrics[f"{condition}.{mode}.shape.pavpu@0.01"] >= 0
    assert set(k for k in metrics if k.startswith("sweep.")) == {f"sweep.{v}.{m}" for v in ("0", "1", "5")
                                                                  for m in ("acc", "pavpu@0.01", "pavpu@0.05", "pavpu@0.1")}
    assert metrics["sweep.5.acc"] == metrics["noisy_acc"] and metrics["sweep.0.acc"] == metrics["test_acc"]
    info = json.loads((tmp_path / "diagnostics" / "attention-diagnostics.json").read_text())
    assert info["chains"] == 2 and len(info["queries"]) == len(info["texts"]) == 3
    assert info["ess_bulk_min"] > 80 and info["r_hat_max"] < 1.08  # independent draws: ESS near 200, R-hat near 1
    summary = pd.read_csv(tmp_path / "diagnostics" / "attention-summary.csv")
    assert {"word", "mean", "hdi_3%", "hdi_97%", "ess_bulk", "r_hat"} <= set(summary.columns)
    assert summary["layer"].str.contains("guided_attention").all()
    assert (tmp_path / "figures" / "attention.png").stat().st_size > 10_000


def results_table():
    rows = []
    for seed in range(3):
        for variant, gain in (("soft", 0.0), ("wc", 1.0)):
            row = {"dataset": "easy-vqa", "variant": variant, "seed": seed, "test_acc": 90 + gain + seed,
                   "noisy_acc": 60 + 2 * gain + seed, "clean.full.pavpu@0.05": 80 + gain, "noisy.full.pavpu@0.05": 70 + gain}
            for v in (0, 1, 5):
                row[f"sweep.{v}.acc"] = 90 - 5 * v + gain
                row[f"sweep.{v}.pavpu@0.05"] = 80 - 2 * v + gain
            rows.append(row)
    return pd.DataFrame(rows)


def test_table2_layout_pairs_each_figure_with_soft():
    found = tables(results_table())
    table2 = found["table2"].set_index("variant")
    assert table2.loc["wc", "accuracy, original"] == "92.00 ± 1.00"
    assert table2.loc["wc", "paper (acc orig / noisy, PAvPU orig / noisy)"] == "67.02 / 62.89 / 71.21 / 66.75"
    paired = found["table2-paired"].set_index("variant")
    assert paired.loc["wc", "accuracy, noisy - soft"].startswith("+2.00 ± 0.00")
    assert paired.loc["wc", "paper - soft"] == "+0.07 / +1.64 / +1.17 / +1.41"
    assert list(found["noise-sweep"]["variance"][:3]) == [0, 1, 5]
    assert TASK.tables is tables
    alone = tables(results_table().query("variant == 'wc'"))  # a sweep of one variant: nothing to pair
    assert "table2-paired" not in alone and alone["table2"]["variant"].tolist() == ["wc"]


def test_noise_sweep_figure_and_attention_picture(tmp_path):
    assert noise_sweep_figure(results_table(), tmp_path / "sweep.png").stat().st_size > 10_000
    assert noise_sweep_figure(pd.DataFrame({"variant": ["soft"], "seed": [0]}), tmp_path / "none.png") is None
    image = np.full((64, 64, 3), 200, dtype=np.uint8)
    weights = np.array([[0.0, 1.0], [0.5, 0.5]])
    lit = spotlight(image, weights)
    assert lit[0, 40, 0] == 200 and lit[0, 0, 0] == 50  # the heaviest cell keeps its brightness
    view = QuestionView(image=image, question="is there a circle?", words=["is", "there", "a", "circle"],
                        attention_draws=np.random.default_rng(0).dirichlet(np.ones(4), 20), prior=np.full(4, 0.25),
                        answer_draws=np.random.default_rng(1).dirichlet(np.ones(13), 20), answers=[str(a) for a in range(13)],
                        truth=3, pvalue=0.2, image_weights=weights)
    assert attention_picture([view, view], tmp_path / "attention.png").stat().st_size > 10_000


@pytest.mark.parametrize("option, message", [
    (["--noise-sweep", "1,x"], "noise_sweep must be comma-separated numbers, got '1,x'"),
    (["--noise-sweep", "2,-1"], "noise_sweep must be a list of finite variances >= 0"),
    (["--grid", "5"], "grid must be 4, 8 or 16"),
    (["--samples", "1"], "samples must be 0 or at least 2"),
    (["--features", "24"], "features must be a multiple of 16"),
])
def test_bad_settings_end_the_command_with_one_line(option, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        experiments.vqa.task.main([*option, "--out", str(tmp_path)])
    assert stopped.value.code == 2 and message in capsys.readouterr().err
