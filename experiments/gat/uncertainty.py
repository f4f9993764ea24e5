"""Uncertainty of the Bayesian GAT (paper, appendix B.2.1 on graphs): posterior draws, their metrics,
ArviZ diagnostics of the attention, and the figures of a sweep.

Sampling modes: ``mc_dropout`` (soft GAT: MC dropout, its only source of uncertainty, as in the
paper), ``attention`` (BAM: attention noise q(S | Phi), network in eval mode) and
``attention_dropout`` (BAM: both, as the paper's VQA experiment). A run's metrics of mode m are the
columns ``m.<metric>``; the test nodes' mean predictive probabilities go into the run's folder
(``<mode>-probs.npz``) for the reliability diagrams.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import pandas as pd
import torch
from torch_geometric.utils import add_self_loops, degree, remove_self_loops

from analysis.curves import training_curves
from bam_pyro.diagnostics import AttentionDiagnostics, attention_chains, gather, neighbourhoods
from bam_pyro.metrics import PAVPU_THRESHOLDS, Reliability, reliability, uncertainty_report
from analysis.plots import neighbourhood_forest, prior_posterior, reliability_diagram, variant_comparison
from analysis.tables import format_mean_std
from bam_pyro.distributed import Engine
from bam_pyro.predictive import attention_site_names, predictive_draws
from experiments.records import RunFolder, read_arrays
from experiments.runner.draws import shared_draws
from experiments.runner.shift_draws import sampling_modes
from bam_pyro.pyg import NodeClassifier

MODE_NOTE = {
    "mc_dropout": "MC dropout (soft attention is deterministic)",
    "attention": "attention noise q(S|Phi), eval mode",
    "attention_dropout": "attention noise and MC dropout",
}
METRICS = ["sample_acc", "nll", "brier", "ece", "entropy", "mutual_info", *(f"pavpu@{t:g}" for t in PAVPU_THRESHOLDS)]


def score_modes(model: NodeClassifier, data, settings, folder: Path, engine: Optional[Engine] = None) -> dict[str, float]:
    """Every mode's metrics of ``settings.samples`` draws on the test nodes (:func:`draws_on_test_nodes`);
    saves their mean probabilities (with the labels) into ``folder``."""
    metrics = {}
    labels = data.y[data.test_mask].cpu()
    for mode in sampling_modes(model):
        samples = draws_on_test_nodes(model, data, settings, "dropout" in mode, engine)
        metrics.update(uncertainty_report(samples, labels, prefix=f"{mode}."))
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / f"{mode}-probs.npz", probs=samples.mean(0).numpy(), labels=labels.numpy())
    return metrics


def draws_on_test_nodes(model: NodeClassifier, data, settings, dropout: bool, engine: Optional[Engine] = None) -> torch.Tensor:
    """``settings.samples`` draws of the test nodes' class probabilities ``[samples, nodes, classes]``
    (float64, on the CPU). A draw is a pass over the whole graph, so the draws are split into
    chunks (``settings.chunk``, with MC dropout ``settings.dropout_chunk``): chunk ``c`` is drawn
    seeded by (the run's seed, ``c``), by its share's process of ``engine``'s
    (:func:`~experiments.runner.draws.shared_draws`): the same draws on any number of processes."""
    test = data.test_mask.nonzero().flatten()
    chunk = settings.dropout_chunk if dropout else settings.chunk
    sizes = [min(chunk, settings.samples - start) for start in range(0, settings.samples, chunk)]

    def draw(index: int) -> torch.Tensor:
        return predictive_draws(model, (data.x, data.edge_index), sizes[index], dropout=dropout,
                                chunk_size=chunk).probs[:, test].cpu()

    samples = torch.cat(shared_draws(draw, len(sizes), settings.seed, engine)).double()
    return samples / samples.sum(-1, keepdim=True)


def attention_diagnostics(model: NodeClassifier, data, settings, folder: Path, engine: Optional[Engine] = None) -> None:
    """ArviZ data, summary and plots of the attention into a few test nodes (:mod:`bam_pyro.diagnostics`),
    ``settings.chains`` independent chains of ``settings.samples`` (at least 100) draws each (each
    process of ``engine`` drawing its share of the chains)."""
    edges = add_self_loops(remove_self_loops(data.edge_index)[0], num_nodes=data.num_nodes)[0]
    in_degree = degree(edges[1], data.num_nodes)
    test = data.test_mask.nonzero().flatten()
    nodes = test[(in_degree[test] >= 4) & (in_degree[test] <= 8)][: settings.diag_nodes].tolist()
    hoods = neighbourhoods(edges.cpu().numpy(), nodes)
    layers = attention_site_names(model)
    posterior, prior = attention_chains(model, (data.x, data.edge_index), max(settings.samples, 100), seed=settings.seed,
                                        chains=settings.chains, layers=layers, select_attention=lambda w: gather(w, hoods),
                                        chunk_size=settings.chunk, engine=engine)
    diagnostics = AttentionDiagnostics.of(posterior, prior, queries=nodes, key_node=hoods.sources)
    diagnostics.write(folder / "diagnostics")
    neighbourhood_forest(diagnostics.idata, layers[0], nodes[0], folder / "figures" / "forest.png")
    prior_posterior(diagnostics.idata, layers[-1], nodes[0], 0, folder / "figures" / "prior-posterior.png")


def long_format(results: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, mode) with the mode's metrics as plain columns."""
    rows = []
    for mode in MODE_NOTE:
        columns = {f"{mode}.{m}": m for m in METRICS[1:]}
        columns[f"{mode}.accuracy"] = "sample_acc"  # of the mean of the draws; test_acc: of the posterior mean
        present = results.dropna(subset=[c for c in columns if c in results]) if set(columns) <= set(results) else None
        if present is not None and not present.empty:
            rows.append(present[["dataset", "variant", "seed", "test_acc", *columns]].rename(columns=columns).assign(mode=mode))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()


def uncertainty_table(results: pd.DataFrame, paper: Mapping[str, Mapping[str, float]]) -> pd.DataFrame:
    """Mean ± std over seeds per (data set, variant, mode), with the paper's accuracy."""
    runs = long_format(results)
    grouped = runs.groupby(["dataset", "variant", "mode"], sort=False)
    table = pd.DataFrame(index=grouped.size().index)
    table["seeds"] = grouped.size()
    table["paper test_acc"] = [paper.get(d, {}).get(v, "") for d, v, _ in table.index]
    digits = {"nll": 3, "brier": 3, "entropy": 3, "mutual_info": 4}
    for metric in ["test_acc", *METRICS]:
        d = digits.get(metric, 2)
        table[metric] = grouped[metric].agg(lambda v: format_mean_std(v.mean(), v.std(ddof=1), d))
    return table


def reliability_curves(runs: pd.DataFrame, folder: RunFolder) -> dict[str, Reliability]:
    """Reliability data per variant and mode of one data set's runs (:func:`long_format` rows; the
    curves are named by variant and mode), from the test probabilities that each one's first seed
    saved in ``folder``; a run that saved none is left out."""
    curves = {}
    for (dataset, variant, mode), group in runs.groupby(["dataset", "variant", "mode"], sort=False):
        seed = int(group["seed"].min())
        saved = folder.run_dir(f"{dataset}-{variant}-seed{seed}") / f"{mode}-probs.npz"
        if saved.exists():
            arrays = read_arrays(saved, ("probs", "labels"))
            curves[f"{variant} ({mode}, seed {seed})"] = reliability(arrays["probs"], arrays["labels"])
    return curves


def draw_figures(results: pd.DataFrame, out: Path) -> None:
    """Training curves of every run; with uncertainty, a variant comparison and reliability
    diagrams per data set (the first seed of each variant and mode)."""
    folder = RunFolder(out)
    records = [r for r in folder.records() if r.get("training")]
    if records:
        training_curves(records, out / "figures" / "training-curves.png")
    runs = long_format(results)
    if runs.empty:
        return
    for dataset, rows in runs.groupby("dataset", sort=False):
        grouped = rows.groupby(["variant", "mode"], sort=False)
        summary = grouped.mean(numeric_only=True).add_suffix("_mean").join(grouped.std(numeric_only=True).add_suffix("_std"))
        summary = summary.reset_index().assign(dataset=dataset)
        summary["variant"] = summary["variant"] + "/" + summary["mode"]
        variant_comparison(summary, ["test_acc", "ece", "pavpu@0.05"], out / "figures" / f"{dataset}-variants.png")
        curves = reliability_curves(rows, folder)
        if curves:
            reliability_diagram(curves, out / "figures" / f"{dataset}-reliability.png", title=f"{dataset} test nodes")
