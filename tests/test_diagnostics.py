"""ArviZ conversion of attention draws: shapes, dims, padding, summary and plots."""

import warnings

import numpy as np
import pytest
import torch

from bam_pyro.diagnostics import attention_inference_data, attention_summary, gather, neighbourhoods

# edges (source -> target): node 0 has 3 incoming edges, node 1 has 1 (its self-loop), node 2 has 2
EDGE_INDEX = np.array([[0, 1, 2, 1, 0, 2], [0, 0, 0, 1, 2, 2]])


def test_neighbourhoods_pad_with_minus_one():
    hoods = neighbourhoods(EDGE_INDEX, [0, 1, 2])
    assert hoods.edges.tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]
    assert hoods.sources.tolist() == [[0, 1, 2], [1, -1, -1], [0, 2, -1]]
    with pytest.raises(ValueError, match="without incoming edges"):
        neighbourhoods(EDGE_INDEX[:, :3], [1])


def test_gather_lays_out_edges_per_node():
    hoods = neighbourhoods(EDGE_INDEX, [0, 2])
    weights = torch.arange(6.0).reshape(1, 6, 1).expand(2, 6, 2) * torch.tensor([1.0, 10.0])
    out = gather(weights, hoods)
    assert out.shape == (2, 2, 2, 3)  # draws, heads, query, key
    assert out[0, 1, 1, :2].tolist() == [40.0, 50.0] and np.isnan(out[0, 1, 1, 2].item())


def random_chains(chains=3, draws=50, seed=0):
    """Layer "a": 2 heads, layer "b": 1 head; node 1's only weight is constant 1."""
    rng = np.random.default_rng(seed)
    hoods = neighbourhoods(EDGE_INDEX, [0, 1, 2])
    result = []
    for _ in range(chains):
        layers = {}
        for name, heads in (("a", 2), ("b", 1)):
            w = torch.as_tensor(rng.dirichlet(np.ones(3), size=(draws, heads)), dtype=torch.float64)
            edge_w = torch.stack([w[..., 0], w[..., 1], w[..., 2], torch.ones(draws, heads), w[..., 0] / (w[..., 0] + w[..., 1]), w[..., 1] / (w[..., 0] + w[..., 1])], 1)
            layers[name] = gather(edge_w, hoods).numpy()
        result.append(layers)
    return result, hoods


def test_inference_data_dims_shapes_and_padding():
    chains, hoods = random_chains()
    idata = attention_inference_data(chains, queries=[10, 11, 12], key_node=hoods.sources, prior_chains=chains[:2])
    att = idata.posterior["attention"]
    assert att.dims == ("chain", "draw", "layer", "head", "query", "key")
    assert att.shape == (3, 50, 2, 2, 3, 3)
    assert list(att.coords["layer"].values) == ["a", "b"] and list(att.coords["query"].values) == [10, 11, 12]
    assert idata.prior["attention"].shape == (2, 50, 2, 2, 3, 3)
    valid = idata.constant_data["valid"]
    assert int(valid.sum()) == 6 * 2 + 6  # 6 edges x 2 heads in "a", 6 edges x 1 head in "b"
    assert not bool(valid.sel(layer="b", head=1).any())  # absent head
    assert idata.constant_data["key_node"].sel(query=12).values.tolist() == [0, 2, -1]


def test_summary_excludes_padded_and_constant_entries_without_warnings():
    chains, hoods = random_chains()
    idata = attention_inference_data(chains, queries=[10, 11, 12], key_node=hoods.sources)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = attention_summary(idata)
    # 18 valid entries; node 11's single weight (2 heads in "a", 1 in "b") never varies
    assert len(summary) == 15 and summary.attrs["constant_entries"] == 3
    assert summary.index.names == ["layer", "head", "query", "key"]
    assert summary[["mean", "sd", "ess_bulk", "r_hat"]].notna().all().all()
    assert summary.loc[("b", 0, 12, 0), "key_node"] == 0
    # independent draws: R-hat near 1 and ESS near the number of draws
    assert summary["r_hat"].max() < 1.1 and summary["ess_bulk"].min() > 50
    row = summary.loc[("a", 1, 10, 2)]
    flat = np.concatenate([c["a"][:, 1, 0, 2] for c in chains])
    assert row["mean"] == pytest.approx(flat.mean(), abs=1e-3)


def test_inconsistent_chains_are_refused():
    chains, _ = random_chains(chains=2)
    chains[1] = {"a": chains[1]["a"][:10], "b": chains[1]["b"][:10]}
    with pytest.raises(ValueError, match="expected"):
        attention_inference_data(chains)
    with pytest.raises(ValueError, match="at least one chain"):
        attention_inference_data([])


def test_plots_write_png(tmp_path):
    from bam_pyro.metrics import reliability
    from analysis.plots import neighbourhood_forest, prior_posterior, reliability_diagram

    chains, hoods = random_chains(chains=2, draws=20)
    idata = attention_inference_data(chains, queries=[10, 11, 12], key_node=hoods.sources, prior_chains=chains)
    paths = [
        neighbourhood_forest(idata, "a", 10, tmp_path / "forest.png"),
        prior_posterior(idata, "b", 12, 0, tmp_path / "pp.png"),
        reliability_diagram({"toy": reliability(np.array([[0.8, 0.2], [0.3, 0.7]]), np.array([0, 0]))}, tmp_path / "rel.png"),
    ]
    for path in paths:
        assert path.exists() and path.read_bytes()[:4] == b"\x89PNG"


def test_variant_bars_start_at_zero_and_hold_their_error_bars(tmp_path, monkeypatch):
    import pandas as pd

    from analysis import plots

    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: figures.append(fig) or path)
    summary = pd.DataFrame(dict(dataset="cora", variant=["soft", "wc"], acc_mean=[81.7, 83.9], acc_std=[0.9, 3.0]))
    plots.variant_comparison(summary, ["acc"], tmp_path / "variants.png")
    low, high = figures[0].axes[0].get_ylim()
    assert low == 0 and high >= 83.9 + 3.0  # bar lengths are the values; no error bar is cut
