"""analysis.curves (and its command, experiments.curves): the kept epoch and the run's best read back from the records of real training runs."""

import pandas as pd
import pytest
import torch

import matplotlib.pyplot as plt

from analysis.curves import curves_figure
from experiments.curves import main as curves_main
from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.training import EarlyStopping, SVITrainer, seed_everything
from bam_pyro import AttentionGuide
from experiments.records import RunFolder, new_record
from models.gat import build_node_classifier

from .conftest import random_graph


def toy_record(name: str, history: list[dict], kept: int, monitors=None) -> dict:
    training = {"epochs": len(history), "best_epoch": kept, "monitors": monitors, "history": history, "seconds": 1.0}
    return {**new_record("toy", {"seed": 0}, {}, training, 1.0), "run": name}


def save_record(out, name: str, history: list[dict], kept: int, monitors=None) -> None:
    record = toy_record(name, history, kept, monitors)
    RunFolder(out).save(name, {k: v for k, v in record.items() if k != "run"})


def train_run(out, name: str, seed: int) -> tuple[list[dict], int]:
    """A tiny GAT trained for 25 epochs with GAT's early-stopping rule, its record saved in
    ``out``; (history, kept epoch)."""
    seed_everything(seed)
    x, edge_index, y = random_graph(num_nodes=40, num_edges=160, seed=seed)
    model = build_node_classifier(x.size(1), 3, BamConfig("wc", k=2.0), ObjectiveConfig(anneal_rate=0.3), dropout=0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    trainer = SVITrainer(model, AttentionGuide(model.model), optimizer)
    batch = ((x, edge_index), dict(y=y, nodes=torch.arange(20)))

    def evaluate():
        logits = model.network(x, edge_index)[20:]
        loss = torch.nn.functional.cross_entropy(logits, y[20:]).item()
        return {"val_loss": loss, "val_acc": (logits.argmax(-1) == y[20:]).float().mean().item()}

    stopping = EarlyStopping({"val_loss": "min", "val_acc": "max"}, patience=100)
    result = trainer.fit(lambda: [batch], evaluate, 25, stopping, progress=False)
    save_record(out, name, result.history, result.best_epoch, result.monitors)
    return result.history, result.best_epoch


def test_curves_report_the_kept_epoch_and_each_metrics_best(tmp_path):
    runs = {}
    for seed in (0, 1):
        runs[f"toy-wc-seed{seed}"] = train_run(tmp_path / "gat", f"toy-wc-seed{seed}", seed)
    table = curves_main([str(tmp_path / "gat"), "--out", str(tmp_path / "out")])

    assert list(table["run"]) == ["toy-wc-seed0", "toy-wc-seed1"]
    assert (table["group"] == "toy-wc").all()
    for _, row in table.iterrows():
        history, kept = runs[row["run"]]
        frame = pd.DataFrame(history)
        assert row["epochs"] == 25 and row["kept_epoch"] == kept
        assert row["kept_val_loss"] == frame.loc[kept, "val_loss"]
        assert row["best_val_loss"] == frame["val_loss"].min()  # the loss is minimized,
        assert row["best_val_acc"] == frame["val_acc"].max()  # the accuracy maximized
        assert frame.loc[row["best_val_loss_epoch"], "val_loss"] == row["best_val_loss"]
    assert pd.read_csv(tmp_path / "out" / "curves.csv").shape[0] == 2
    assert "median kept_val_loss" in (tmp_path / "out" / "summary.md").read_text()
    assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000


def test_curves_name_a_folder_without_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no finished runs in"):
        curves_main([str(tmp_path), "--out", str(tmp_path / "out")])


def test_resuming_with_other_monitors_is_refused():
    stop = EarlyStopping({"val_loss": "min"})
    with pytest.raises(ValueError, match="monitored"):
        stop.load_state_dict(EarlyStopping({"val_acc": "max"}).state_dict())


def test_curves_of_runs_with_different_metrics(tmp_path):
    """GAT and two GLUE tasks in one folder: each run's own metrics, no cell for a metric it lacks."""
    folder = tmp_path / "mixed"
    train_run(folder, "toy-wc-seed0", 0)
    glue = {"cola": {"matthews": [10.0, 30.0, 20.0], "eval_seconds": [4.0, 7.0, 5.0]},  # a timing: not a metric
            "stsb": {"pearson": [80.0, 85.0, 86.0], "spearman": [79.0, 84.0, 83.0]}}
    for task, metrics in glue.items():  # GLUE's runs: no early stopping, the last epoch is kept
        history = [{"epoch": e, "loss": 1.0 / (e + 1), **{m: v[e] for m, v in metrics.items()}} for e in range(3)]
        save_record(folder, f"{task}-wc-seed0", history, 2)
    table = curves_main([str(folder), "--out", str(tmp_path / "out")]).set_index("run")

    assert table.loc["cola-wc-seed0", ["kept_epoch", "kept_matthews", "best_matthews", "best_matthews_epoch"]].tolist() == [2, 20.0, 30.0, 1]
    assert table.loc["stsb-wc-seed0", ["kept_spearman", "best_spearman"]].tolist() == [83.0, 84.0]
    assert pd.isna(table.loc["stsb-wc-seed0", "kept_matthews"]) and pd.isna(table.loc["cola-wc-seed0", "kept_val_loss"])
    assert table.loc["toy-wc-seed0", "kept_val_loss"] > 0
    assert not any("seconds" in column for column in table.columns)
    assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000


def test_overlaid_curves_share_one_axis_a_colour_per_group_and_a_log_scale_over_a_wide_range():
    def perplexities(start):  # falls from start to about 6: a wide range
        return [{"epoch": e, "loss": 1.0, "val_ppl": 6 + start / (e + 1) ** 2} for e in range(6)]

    records = [toy_record(f"mt-{variant}-seed{seed}", perplexities(30 + seed), 5, {"val_ppl": "min"})
               for variant in ("soft", "wc") for seed in (0, 1)]
    overlaid, apart = curves_figure(records, overlay=True), curves_figure(records)
    (ax,) = overlaid.axes
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["mt-soft", "mt-wc"]  # a group once
    colours = [line.get_color() for line in ax.get_lines() if not line.get_marker() or line.get_marker() == "None"]
    assert colours[0] == colours[1] != colours[2] == colours[3]  # seeds share their group's colour
    assert ax.get_yscale() == "log"
    assert len(apart.axes) == 2 and all(a.get_title() in ("mt-soft", "mt-wc") for a in apart.axes)
    narrow = [toy_record("mt-soft-seed0", [{"epoch": e, "val_acc": 80.0 + e} for e in range(4)], 3)]
    assert curves_figure(narrow, overlay=True).axes[0].get_yscale() == "linear"
    plt.close("all")
