"""GLUE data from the shared tsv files, the GLUE metrics, and length-bucketed batches."""

import dataclasses
import numpy as np
import pandas as pd
import pytest
import torch

from bam_pyro.metrics import uncertainty_report
from experiments.glue.task import TASK, scores, side_by_side
from experiments.glue.data import TASKS, Encoded, batches, holdout_split, matthews, read_split, subset, task_metrics


def settings_for(task, variant, seed, model, overrides):
    return TASK.settings_for(task, variant, seed, {"model": model, **overrides})


def collator():
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from bam_pyro.transformers import DEFAULT_MODEL, resolve_pretrained

    return DataCollatorWithPadding(AutoTokenizer.from_pretrained(resolve_pretrained(DEFAULT_MODEL)), return_tensors="pt")

SIZES = {"rte": (2490, 277), "mrpc": (3668, 408), "cola": (8551, 1043), "stsb": (5749, 1500), "sst2": (67349, 872)}


@pytest.mark.parametrize("task", sorted(SIZES))
def test_reads_real_tsv(task, data_root):
    for split, size in zip(("train", "dev"), SIZES[task]):
        frame = read_split(task, split, data_root)
        assert len(frame) == size
        assert (frame["text_a"].str.len() > 0).all()
        assert ("text_b" in frame) == (len(TASKS[task].text_columns) == 2)
        if TASKS[task].is_regression:
            assert frame["label"].between(0, 5).all()
        else:
            assert set(frame["label"]) == {0, 1}


def test_missing_file_is_named(tmp_path):
    (tmp_path / "glue" / "RTE").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"train\.tsv.*RTE"):
        read_split("rte", "train", tmp_path)
    with pytest.raises(ValueError, match="unknown GLUE task"):
        read_split("qqp", "train", tmp_path)


@pytest.mark.parametrize("task", ["rte", "stsb", "sst2"])
def test_without_a_data_root_the_hub_copy_is_read_in_the_tsv_columns(task, tmp_path, monkeypatch, data_root):
    """No data root anywhere (a user's machine): ``datasets`` fetches GLUE from the hub. The hub
    is out of reach here, so its answer is the tsv's rows in the hub's columns and label codes."""
    import datasets

    from experiments.glue import data as glue_data

    tsv = read_split(task, "dev", data_root).head(5)
    texts = ("sentence1", "sentence2") if "text_b" in tsv else ("sentence",)
    hub = datasets.Dataset.from_dict({**{c: list(tsv[t]) for c, t in zip(texts, ("text_a", "text_b"))},
                                      "label": list(tsv["label"]), "idx": list(range(5))})
    asked = []
    monkeypatch.setattr(glue_data, "resolve_data_root", lambda root: (tmp_path, False))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: asked.append((a, kw)) or hub)
    frame = read_split(task, "dev")
    assert asked == [(("nyu-mll/glue", task), {"split": "validation", "cache_dir": str(tmp_path / "datasets")})]
    pd.testing.assert_frame_equal(frame, tsv.reset_index(drop=True))


def test_metrics_on_known_cases():
    pred, label = np.array([1, 1, 0, 0, 1]), np.array([1, 0, 0, 1, 1])
    scores = task_metrics("mrpc", pred, label)
    assert scores["accuracy"] == pytest.approx(60.0)
    assert scores["f1"] == pytest.approx(100 * 2 * 2 / (3 + 3))
    # MCC = (tp*tn - fp*fn) / sqrt(...) with tp=2, tn=1, fp=1, fn=1
    assert task_metrics("cola", pred, label)["matthews"] == pytest.approx(100 * (2 - 1) / np.sqrt(3 * 3 * 2 * 2))
    assert matthews(np.ones(4, int), np.array([0, 1, 0, 1])) == 0.0  # constant predictor
    assert matthews(np.array([1, 0, 1, 0]), np.array([0, 1, 0, 1])) == pytest.approx(-1.0)  # always wrong
    sts = task_metrics("stsb", np.array([0.1, 0.4, 0.2, 3.0]), np.array([1.0, 3.0, 2.0, 4.0]))
    assert sts["spearman"] == pytest.approx(100.0)
    assert 0 < sts["pearson"] < 100


def test_scores_predict_the_top_class_and_uncertainty_is_in_percent():
    outputs = np.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [5.0, 4.0]])
    assert scores("rte", outputs, np.array([0, 1, 1, 0])) == {"accuracy": 75.0}  # the lowest class: 25
    # two identical draws, 0.8 on class 0 for both items, one of them right: ECE |0.5 - 0.8|; the
    # t-test finds both certain, so PAvPU is the accuracy
    samples = np.tile([[0.8, 0.2]], (2, 2, 1))
    metrics = uncertainty_report(samples, np.array([0, 1]))
    assert metrics["ece"] == pytest.approx(30.0) and metrics["pavpu@0.05"] == pytest.approx(50.0)
    assert metrics["nll"] == pytest.approx(-(np.log(0.8) + np.log(0.2)) / 2)


def test_draws_are_zero_or_at_least_two_and_kept_for_classification_only():
    with pytest.raises(ValueError, match="draws must be 0"):
        settings_for("rte", "wc", 0, "model", {"draws": 1})
    assert settings_for("rte", "wc", 0, "model", {"draws": 5}).row()["draws"] == 5
    assert settings_for("stsb", "wc", 0, "model", {"draws": 5}).row()["draws"] == 0  # regression: no uncertainty


def test_batches_pad_per_batch_and_cover_everything():
    lengths = [3, 9, 4, 7, 5, 2, 8]
    data = Encoded([list(range(1, n + 1)) for n in lengths], [[0] * n for n in lengths], torch.arange(7))
    seen = []
    for (ids, mask, types), targets in batches(data, 3, collator(), shuffle=True, rng=np.random.default_rng(0)):
        assert ids.shape == mask.shape == types.shape
        assert ids.shape[1] == mask.sum(1).max()  # padded to the batch's longest only
        assert torch.equal(mask.sum(1), torch.tensor([lengths[i] for i in targets["labels"]]))
        seen += targets["labels"].tolist()
    assert sorted(seen) == list(range(7))


def test_subset_and_table():
    frame = pd.DataFrame({"x": range(10)})
    assert subset(frame, 4).equals(subset(frame, 4)) and len(subset(frame, 4)) == 4
    results = pd.DataFrame({"task": ["rte"] * 4, "variant": ["soft", "soft", "wc", "wc"], "seed": [0, 1, 0, 1],
                            "holdout": None, "accuracy": [60.0, 62.0, 63.0, 65.0]})
    table = side_by_side(results)
    assert table.loc[("rte", "accuracy"), "soft"] == "61.00 ± 1.41"
    assert table.loc[("rte", "accuracy"), "wc"] == "64.00 ± 1.41"
    assert table.loc[("rte", "accuracy"), "split"] == "dev"


def test_holdout_split_is_fixed_disjoint_and_scored_apart_from_dev():
    frame = pd.DataFrame({"text_a": [f"s{i}" for i in range(50)], "label": np.arange(50) % 2})
    rest, held_out = holdout_split(frame, 8)
    assert len(held_out) == 8 and len(rest) == 42
    assert set(rest.text_a).isdisjoint(held_out.text_a) and set(rest.text_a) | set(held_out.text_a) == set(frame.text_a)
    assert held_out.equals(holdout_split(frame, 8)[1])  # the same split for every run and variant
    with pytest.raises(ValueError, match="holdout must be between 1 and 49"):
        holdout_split(frame, 50)
    run = settings_for("mrpc", "wc", 0, "model", {"holdout": 8})
    assert run.scored_on == "heldout" and run.row()["holdout"] == 8
    assert settings_for("mrpc", "wc", 0, "model", {}).scored_on == "dev"
    results = pd.DataFrame({"task": "mrpc", "variant": ["soft", "wc"], "seed": 0, "holdout": 8,
                            "accuracy": [70.0, 72.0], "f1": [80.0, 81.0]})
    table = side_by_side(results)
    assert table.loc[("mrpc", "f1"), "split"] == "heldout" and table.loc[("mrpc", "f1"), "wc"] == "81.00"
    assert "paper (ALBERT soft -> WC)" not in table  # the paper's figures are dev scores


def test_posterior_probs_vary_for_bam_only():
    from transformers import BertConfig, BertForSequenceClassification

    from bam_pyro import BamConfig, ObjectiveConfig
    from experiments.glue.task import posterior_probs
    from bam_pyro.transformers import build_sequence_model

    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    lengths = [5, 7, 3, 6]
    data = Encoded([list(range(5, 5 + n)) for n in lengths], [[0] * n for n in lengths], torch.tensor([0, 1, 1, 0]))
    for variant in ("soft", "wc"):
        model = build_sequence_model(BertForSequenceClassification(config), 2, BamConfig(variant, k=5.0), ObjectiveConfig())
        samples, labels = posterior_probs(model, data, 2, collator(), draws=4, seed=0)
        assert samples.shape == ((2 if variant == "soft" else 4), 4, 2)
        assert labels.tolist() == [1, 0, 0, 1]  # in the order of the samples (by length), not of the data
        assert (samples.std(0).max() > 0) == (variant == "wc")
        assert 0 <= uncertainty_report(samples, labels)["pavpu@0.05"] <= 100


def test_posterior_draws_of_nearly_deterministic_attention_are_the_posterior_mean_prediction():
    """At k = 1e6 every draw of q is its mean, so the draws the uncertainty metrics read must give
    the probabilities of the point prediction that the task's accuracy reads, item by item. The
    committed BAM-WC records of b2b41b9 (k = 1000) failed this: their draws scored NLL log 2 beside
    an accuracy equal to soft's (the fused path's output scrambled under Predictive's plate)."""
    from scipy.special import softmax
    from transformers import BertConfig, BertForSequenceClassification

    from bam_pyro import BamConfig, ObjectiveConfig
    from bam_pyro.transformers import build_sequence_model
    from experiments.glue.task import posterior_probs, predict

    torch.manual_seed(0)
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                        initializer_range=0.3)  # outputs that attention moves
    lengths = [5, 7, 3, 6, 7]
    data = Encoded([[5 + (3 * i + j) % 50 for j in range(n)] for i, n in enumerate(lengths)], [[0] * n for n in lengths],
                   torch.tensor([0, 1, 1, 0, 1]))
    model = build_sequence_model(BertForSequenceClassification(config), 2, BamConfig("wc", k=1e6), ObjectiveConfig())
    outputs, labels = predict(model.network, data, 2, collator())
    samples, drawn_labels = posterior_probs(model, data, 2, collator(), draws=3, seed=0)
    assert drawn_labels.tolist() == labels.tolist()
    assert np.abs(softmax(outputs, -1) - 0.5).max() > 0.05  # a prediction that is not a coin
    np.testing.assert_allclose(samples, np.broadcast_to(softmax(outputs, -1), samples.shape), atol=1e-4)


def test_training_epochs_are_shuffled_differently_and_reproducibly(monkeypatch, tmp_path, tiny_bert_folder):
    """The training batches' order per epoch, read off the batches the task's train draws."""
    import experiments.glue.task as glue
    from experiments.glue.data import GlueData
    from experiments.runner import RunContext

    orders = []

    def recorded(data, batch_size, collate, shuffle, rng=None):
        for args, targets in batches(data, batch_size, collate, shuffle, rng):
            if shuffle:
                orders.append(args[0][:, 1].tolist())  # the token after [CLS] tells the examples apart
            yield args, targets

    monkeypatch.setattr(glue, "batches", recorded)
    train = Encoded([[101, 1000 + i, 102] for i in range(8)], [[0] * 3] * 8, torch.arange(8) % 2)  # one length: no sorting
    settings = settings_for("rte", "soft", 0, str(tiny_bert_folder), {"epochs": 2, "batch_size": 2, "draws": 0})
    runs = []
    for attempt in range(2):
        orders.clear()
        glue.train(settings, GlueData(train, train, collator()), RunContext(tmp_path / str(attempt), settings, progress=False))
        runs.append([sum(orders[:4], []), sum(orders[4:], [])])  # 4 batches per epoch
    assert sorted(runs[0][0]) == sorted(runs[0][1]) and runs[0][0] != runs[0][1]
    assert runs[0] == runs[1]


def test_glue_script_trains_scores_tabulates_and_skips_finished_runs(tmp_path, data_root, tiny_bert_folder):
    """experiments.glue end to end on real RTE data with a tiny randomly initialized BERT saved
    beside the MiniLM tokenizer: both variants train, are scored on dev, side by side; asking
    again trains nothing, and with another number of draws is refused."""
    from experiments.glue.task import main as glue

    argv = ["--task", "rte", "--variant", "soft", "wc", "--seeds", "0", "--model", str(tiny_bert_folder),
            "--data-root", str(data_root), "--out", str(tmp_path / "glue"), "--max-train", "48", "--epochs", "1",
            "--max-length", "32", "--draws", "2", "--threads", "1", "--no-progress"]
    table = glue(argv)["glue"].set_index(["task", "metric"])

    rows = pd.read_csv(tmp_path / "glue" / "results.csv")
    assert sorted(rows.variant) == ["soft", "wc"] and (rows.max_train == 48).all()
    assert rows.accuracy.between(30, 70).all()  # an untrained tiny model on balanced dev data
    assert rows["pavpu@0.05"].notna().all() and rows.nll.gt(0).all()
    soft = rows.set_index("variant").loc["soft"]  # deterministic: every example certain, PAvPU = accuracy
    assert soft["pavpu@0.05"] == pytest.approx(soft.accuracy)
    accuracy = table.loc[("rte", "accuracy")]
    assert accuracy["soft"] == f"{rows.set_index('variant').accuracy['soft']:.2f}"  # one run: no ± std
    assert accuracy["wc - soft (paired)"].startswith(("+", "-")) and accuracy["n"] == 1
    assert "wc - soft (paired)" in (tmp_path / "glue" / "table.md").read_text()
    glue(argv)  # finished runs are skipped: no new rows
    assert len(pd.read_csv(tmp_path / "glue" / "results.csv")) == 2
    with pytest.raises(SystemExit):
        glue(argv[:argv.index("--draws") + 1] + ["3"] + argv[argv.index("--draws") + 2:])


@pytest.mark.slow
def test_the_pretrained_minilm_under_bam_learns_sst2(tmp_path, data_root):
    """The default pretrained model with BAM-WC attention, finetuned on real data, learns the task
    (under a minute on 2 cores): 800 SST-2 sentences, 2 epochs, and more attention noise than the
    task's preset (k = 10, not 1000), so that the stochastic path is what gets trained."""
    from experiments.glue.task import main as glue

    glue(["--task", "sst2", "--variant", "wc", "--seeds", "0", "--max-train", "800", "--epochs", "2",
          "--lr", "1e-4", "--k", "10", "--draws", "4", "--data-root", str(data_root), "--out", str(tmp_path),
          "--threads", "2", "--no-progress"])
    row = pd.read_csv(tmp_path / "results.csv").iloc[0]
    assert row.accuracy > 75  # measured 79.7; the dev set's majority class is 50.9%
    assert row.nll < np.log(2)  # better than a coin, in probability as well as in argmax
    assert 0 < row["pavpu@0.05"] <= 100


def test_runs_record_the_model_by_the_name_given_not_where_it_is_installed(tmp_path, data_root, monkeypatch):
    """The default model's folder is inside the virtual environment; recording the name keeps the
    records of two checkouts comparable (collect refuses runs whose model differs)."""
    from experiments.glue import task as glue
    from experiments.runner import run_cli
    from bam_pyro.transformers import DEFAULT_MODEL

    trained = []

    def train(settings, data, run):
        trained.append(settings)
        return {"accuracy": 50.0, "train_loss": 0.7}

    run_cli(dataclasses.replace(glue.TASK, train=train), ["--task", "rte", "--variant", "soft", "--data-root", str(data_root), "--out", str(tmp_path),
               "--max-train", "8", "--threads", "1", "--no-progress"])
    assert [run.model for run in trained] == [DEFAULT_MODEL]
    assert pd.read_csv(tmp_path / "results.csv").model.tolist() == [DEFAULT_MODEL]
