"""The GAT task's uncertainty table end to end on Cora: short training, few posterior draws, ArviZ
diagnostics, figures and the report."""

import pandas as pd
import pytest
import torch

from analysis.report import build_report
from experiments.gat.task import TASK, node_metrics
from experiments.gat.task import main as gat
from experiments.runner import load_trained


def test_uncertainty_table_figures_diagnostics_and_report_on_cora(tmp_path, data_root, capsys):
    out = tmp_path / "graph"

    def argv(*options: str) -> list[str]:
        return ["--dataset", "cora", "--variant", "soft", "wc", "--seeds", "0", "--samples", "4", "--chains", "2",
                "--diag-nodes", "1", "--max-epochs", "3", "--data-root", str(data_root), "--out", str(out),
                "--no-progress", *options]

    table = gat(argv())["uncertainty"]
    assert list(zip(table.variant, table["mode"])) == [("soft", "mc_dropout"), ("wc", "attention"), ("wc", "attention_dropout")]
    rows = pd.read_csv(out / "results.csv").set_index("variant")
    assert (rows.epochs == 3).all() and (rows.samples == 4).all()
    assert rows.loc["wc", "attention.nll"] > 0 and 0 <= rows.loc["soft", "mc_dropout.ece"] <= 100
    assert pd.isna(rows.loc["soft", "attention.nll"])  # soft attention has no attention noise to sample
    figures = {p.relative_to(out).as_posix() for p in out.rglob("*.png")}
    assert {"figures/cora-variants.png", "figures/cora-reliability.png", "figures/training-curves.png",
            "runs/cora-wc-seed0/figures/forest.png", "runs/cora-wc-seed0/figures/prior-posterior.png"} <= figures
    assert not (out / "runs" / "cora-soft-seed0" / "diagnostics").exists()  # no attention posterior to diagnose
    report = build_report(out)
    assert "Attention diagnostics" in report and "figures/training-curves.png" in report
    capsys.readouterr()

    loaded = load_trained(TASK, out / "runs" / "cora-wc-seed0", str(data_root))  # as it was scored
    graph = loaded.data[0]
    with torch.no_grad():
        logits = loaded.model.network(graph.x, graph.edge_index)
    assert 100 * node_metrics(logits, graph.y, graph.val_mask)[1] == pytest.approx(rows.loc["wc", "val_acc"], abs=1e-9)

    for option in (["--samples", "3"], ["--chunk", "2"], ["--chains", "3"]):  # sampling settings are settings too
        with pytest.raises(SystemExit):
            gat(argv(*option))
        assert f"{option[0][2:]}={rows.loc['soft', option[0][2:]]} (asked for {option[1]})" in capsys.readouterr().err
