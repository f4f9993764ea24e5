"""experiments.graph_table end to end on Cora: short training, few posterior draws, then the report."""

import pandas as pd
import pytest

from analysis.report import build_report
from experiments.graph_table import main as graph_table


def test_uncertainty_table_figures_diagnostics_and_report_on_cora(tmp_path, data_root):
    out = tmp_path / "graph"

    def argv(max_epochs: int, *options: str) -> list[str]:
        return ["--dataset", "cora", "--variant", "soft", "wc", "--seeds", "0", "--samples", "4", "--chains", "2",
                "--diag-nodes", "1", "--max-epochs", str(max_epochs), "--data-root", str(data_root), "--out", str(out),
                *options]

    table = graph_table(argv(3))

    assert list(zip(table.variant, table["mode"])) == [("soft", "dropout"), ("wc", "attention"), ("wc", "attention+dropout")]
    assert table.nll_mean.between(0, 10).all() and table.ece_mean.between(0, 100).all()
    rows = pd.read_csv(out / "results.csv")
    assert (rows.epochs == 3).all() and (rows.samples == 4).all()
    figures = {p.name for p in (out / "figures").glob("*.png")}
    assert {"cora-variants.png", "cora-reliability.png", "cora-wc-forest.png", "training-curves.png"} <= figures
    report = build_report(out)
    assert "Attention diagnostics" in report and "figures/training-curves.png" in report

    with pytest.raises(ValueError, match="max_epochs=3 \\(asked for 4\\)"):
        graph_table(argv(4))
    # other sampling settings are refused too, for the scores and for the diagnostics
    with pytest.raises(ValueError, match=r"cora-soft-0-dropout.json .*samples=4 \(asked for 3\)"):
        graph_table(argv(3, "--samples", "3"))
    with pytest.raises(ValueError, match=r"cora-wc-0-attention.json .*chunk=100 \(asked for 2\)"):
        graph_table(argv(3, "--chunk", "2"))
    with pytest.raises(ValueError, match=r"cora-wc-diagnostics.json .*chains=2 \(asked for 3\)"):
        graph_table(argv(3, "--chains", "3"))


def test_invalid_sampling_options_are_named_before_any_training(tmp_path, capsys):
    for option, value, message in (("--chains", "0", "must be at least 1, got 0"), ("--samples", "ten", "expected a whole number"),
                                   ("--samples", "1", "must be at least 2, got 1"), ("--seeds", "-1", "must be at least 0, got -1")):
        with pytest.raises(SystemExit):
            graph_table([option, value, "--data-root", str(tmp_path), "--out", str(tmp_path)])  # no data: nothing to train
        assert f"argument {option}: {message}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything was written
