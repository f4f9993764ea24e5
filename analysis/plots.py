"""Figures as PNG files (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import arviz as az  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import xarray as xr  # noqa: E402

from bam_pyro.metrics import Reliability  # noqa: E402
from bam_pyro.shift import RiskCoverage  # noqa: E402


def save_figure(fig, path: Path, dpi: int = 120, colors: Optional[int] = None) -> Path:
    """Write ``fig`` as PNG (creating the folder) and close it; returns the path. ``colors``: a
    palette of that many colours (for figures of photos, which are several times larger as RGB)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    if colors is not None:
        from PIL import Image

        with Image.open(path) as image:
            palette = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
        palette.save(path, optimize=True)
    plt.close(fig)
    return path


def reliability_diagram(curves: dict[str, Reliability], path: Path, title: str = "") -> Path:
    """Accuracy vs confidence per bin, one line per model; the diagonal is perfect calibration."""
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="calibrated")
    for name, r in curves.items():
        filled = r.counts > 0
        ax.plot(r.confidence[filled], r.accuracy[filled], marker="o", ms=3, label=f"{name} (ECE {100 * r.ece:.1f}%)")
    ax.set(xlabel="confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1), title=title)
    ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, path)


def risk_coverage_curves(curves: dict[str, RiskCoverage], path: Path, title: str = "") -> Path:
    """Selective risk against coverage, one line per model, AURC in the legend: lower is better,
    and the curve's right end is the error rate of answering everything."""
    fig, ax = plt.subplots(figsize=(5, 4))
    for name, curve in curves.items():
        ax.plot(curve.coverage, 100 * curve.risk, lw=1.2, label=f"{name} (AURC {100 * curve.aurc:.1f})")
    ax.set(xlabel="coverage", ylabel="risk (% errors among the kept)", xlim=(0, 1), title=title)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=7)
    return save_figure(fig, path)


def _neighbourhood(idata: az.InferenceData, group: str, layer: str, node) -> xr.DataArray:
    """A node's existing attention entries of one layer: dims (chain, draw, head, source)."""
    att = getattr(idata, group)["attention"].sel(layer=layer, query=node)
    valid = idata.constant_data["valid"].sel(layer=layer, query=node)
    heads = valid.any("key").values
    keys = valid.any("head").values
    att = att.isel(head=np.flatnonzero(heads), key=np.flatnonzero(keys))
    sources = idata.constant_data["key_node"].sel(query=node).values[keys]
    return att.rename(key="source").assign_coords(source=sources)


def neighbourhood_forest(idata: az.InferenceData, layer: str, node, path: Path, hdi_prob: float = 0.94) -> Path:
    """Forest plot of one node's incoming attention weights (every head), chains combined."""
    att = _neighbourhood(idata, "posterior", layer, node)
    axes = az.plot_forest(xr.Dataset({"attention": att}), combined=True, hdi_prob=hdi_prob, figsize=(6, 0.25 * att.sizes["head"] * att.sizes["source"] + 1.5))
    axes[0].set_title(f"node {node}, {layer}: posterior attention ({int(100 * hdi_prob)}% HDI)")
    return save_figure(axes[0].figure, path)


def prior_posterior(idata: az.InferenceData, layer: str, node, head: int, path: Path) -> Path:
    """Prior vs posterior attention of one node over its neighbours (one head): how the data moved
    the attention away from the key-dependent prior (the paper's Figure 1, on a graph). Boxes
    show the spread over draws of each group of ``idata``."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = {"prior": "tab:grey", "posterior": "tab:blue"}
    sources = None
    for i, (group, color) in enumerate(names.items()):
        att = _neighbourhood(idata, group, layer, node).sel(head=head)
        sources = att.coords["source"].values
        draws = att.stack(sample=("chain", "draw")).transpose("source", "sample").values
        positions = np.arange(len(sources)) + (i - 0.5) * 0.35
        box = ax.boxplot(list(draws), positions=positions, widths=0.3, patch_artist=True, showfliers=False)
        for patch in box["boxes"]:
            patch.set(facecolor=color, alpha=0.6)
        ax.plot([], [], color=color, lw=6, alpha=0.6, label=group)
    ax.set_xticks(np.arange(len(sources)), [str(s) for s in sources], rotation=90 if len(sources) > 12 else 0)
    ax.set(xlabel="source node", ylabel="attention weight", ylim=(0, 1), title=f"node {node}, {layer}, head {head}")
    ax.legend()
    return save_figure(fig, path)


def variant_comparison(summary: pd.DataFrame, metrics: Sequence[str], path: Path) -> Path:
    """Bar chart per metric: mean +- std over seeds for each (dataset, variant) row.
    ``summary`` columns: dataset, variant, and ``<metric>_mean`` / ``<metric>_std``. The bars start
    at 0, so their lengths compare as the values do, and the axis holds the error bars."""
    datasets = list(dict.fromkeys(summary["dataset"]))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5), squeeze=False)
    width = 0.8 / len(datasets)
    for ax, metric in zip(axes[0], metrics):
        for i, dataset in enumerate(datasets):
            rows = summary[summary["dataset"] == dataset]
            x = np.arange(len(rows)) + (i - (len(datasets) - 1) / 2) * width
            ax.bar(x, rows[f"{metric}_mean"], width, yerr=rows[f"{metric}_std"], label=dataset, capsize=2)
            ax.set_xticks(np.arange(len(rows)), list(rows["variant"]), rotation=45, ha="right")
        ax.set_title(metric)
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path)


def paired_runs(results: pd.DataFrame, panel: str, metrics: dict[str, str], path: Path, baseline: str = "soft") -> Path:
    """One panel per value of ``panel`` (a task or data set) showing ``metrics[value]`` of every
    run: a grey line joins the variants' runs of one seed, the red line is the mean, so a paired
    gain or loss shows at a glance where mean ± std bars overlap."""
    names = list(dict.fromkeys(results[panel]))
    fig, axes = plt.subplots(1, len(names), figsize=(2.8 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = results[results[panel] == name]
        variants = list(dict.fromkeys(rows["variant"]))
        variants.sort(key=lambda v: v != baseline)  # the baseline first, then in order of appearance
        wide = rows.pivot_table(index="seed", columns="variant", values=metrics[name], aggfunc="last")
        wide = wide.reindex(columns=variants)
        x = np.arange(len(variants))
        for _, scores in wide.iterrows():
            ax.plot(x, scores.to_numpy(), marker="o", color="tab:grey", alpha=0.6, lw=1)
        ax.plot(x, wide.mean().to_numpy(), marker="s", color="tab:red", lw=2, label="mean over seeds")
        ax.set_xticks(x, variants)
        ax.set_xlim(-0.4, len(variants) - 0.6)
        ax.set_title(f"{name}: {metrics[name]}", fontsize=10)
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path)
