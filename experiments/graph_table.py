"""The graph results table: every variant x seed on Planetoid graphs, accuracy and uncertainty.

    python -m experiments.graph_table --dataset cora citeseer --seeds 0 1 2 --samples 100 --out runs/graph

Without ``--dataset`` it runs Cora, CiteSeer and PubMed, skipping those whose data is absent.

Per (dataset, variant, seed): train with the paper's presets (``experiments.gat``), then draw M
posterior samples of the class probabilities of every node and score the test nodes. Test
accuracy is the posterior-mean point prediction; NLL, Brier, ECE, entropy, MI and PAvPU come
from the M samples. Sampling modes: ``attention`` (BAM: q(S | Phi) noise, network in eval mode),
``dropout`` (soft GAT: MC dropout, its only source of uncertainty, as in the paper), and
``attention+dropout`` for BAM-WC on the first seed (both, as the paper's VQA experiment).

Writes into ``--out``: ``rows/*.json`` (one per run and mode; finished runs are skipped, so
several processes may share a folder), ``results.csv``, ``table.csv``, ``table.md``,
``figures/*.png`` and, for BAM-WC, ArviZ diagnostics of the attention of a few test nodes
(``diagnostics/``). ``python -m analysis.report FOLDER`` turns it into a report. A finished run or
diagnosis is reused only if it was made with the settings asked for (training and sampling),
else refused by name.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import pandas as pd
import torch
from torch_geometric.utils import add_self_loops, degree, remove_self_loops

from analysis.curves import read_runs, training_curves
from analysis.diagnostics import attention_inference_data, attention_summary, gather, neighbourhoods
from analysis.metrics import PAVPU_THRESHOLDS, reliability, sample_metrics
from analysis.plots import neighbourhood_forest, prior_posterior, reliability_diagram, variant_comparison
from analysis.tables import format_mean_std
from bam_pyro.predictive import attention_site_names, predictive_draws
from bam_pyro.training import seed_everything
from experiments.gat import PAPER_ACCURACY, settings_for, train_node_classifier
from experiments.planetoid import NAMES, load_planetoid
from experiments.runs import setting_differences, settings_digest, whole_number
from models.gat import NodeClassifier

VARIANTS = ["soft", "nokl", "lf", "lc", "wf", "wc"]
METRICS = ["test_acc", "nll", "brier", "ece", "entropy", "mutual_info"] + [f"pavpu@{t:g}" for t in PAVPU_THRESHOLDS]
MODE_NOTE = {
    "dropout": "MC dropout (soft attention is deterministic)",
    "attention": "attention noise q(S|Phi), eval mode",
    "attention+dropout": "attention noise and MC dropout",
}


def modes_for(variant: str, first_seed: bool) -> list[str]:
    """Sampling modes measured for a variant (see module doc). MC dropout copies the inputs per
    draw and is slow on wide features, so BAM-WC's extra mode runs on the first seed only."""
    if variant == "soft":
        return ["dropout"]
    return ["attention", "attention+dropout"] if variant == "wc" and first_seed else ["attention"]


def gat_edge_index(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """The edge list GAT's attention entries are laid out on: self-loops replaced by one per node."""
    return add_self_loops(remove_self_loops(edge_index)[0], num_nodes=num_nodes)[0]


def sampling_settings(mode: str, args: argparse.Namespace) -> dict[str, int]:
    """What a mode's scores depend on besides training: the number of draws and the draws per
    vectorized pass (the chunks split the random stream, so they change the draws)."""
    return {"samples": args.samples, "chunk": args.dropout_chunk if "dropout" in mode else args.chunk}


def diagnostics_settings(args: argparse.Namespace) -> dict[str, int]:
    """What the attention diagnostics depend on besides training (``draws``: draws per chain)."""
    return {"draws": args.samples, "chunk": args.chunk, "chains": args.chains, "diag_nodes": args.diag_nodes}


def score_run(model: NodeClassifier, data, mode: str, args: argparse.Namespace, seed: int) -> tuple[dict, np.ndarray]:
    """Uncertainty metrics of the test nodes from ``args.samples`` draws, with the sampling
    settings; also the test nodes' mean predictive probabilities (for reliability diagrams)."""
    sampling = sampling_settings(mode, args)
    seed_everything(seed)
    start = time.perf_counter()
    with torch.no_grad():
        draws = predictive_draws(
            model, (data.x, data.edge_index), sampling["samples"], dropout="dropout" in mode, chunk_size=sampling["chunk"],
        )
    seconds = time.perf_counter() - start
    test = data.test_mask.nonzero().flatten()
    samples = draws.probs[:, test].double()
    samples = samples / samples.sum(-1, keepdim=True)
    metrics = sample_metrics(samples, data.y[test])
    metrics = {k: 100 * v if k in ("accuracy", "ece") or k.startswith("pavpu") else v for k, v in metrics.items()}
    metrics["sample_acc"] = metrics.pop("accuracy")
    return {**metrics, "mode": mode, **sampling, "sample_seconds": round(seconds, 2)}, samples.mean(0).numpy()


def attention_diagnostics(model: NodeClassifier, data, out: Path, args: argparse.Namespace, name: str) -> None:
    """ArviZ data, summary and plots of the attention into a few test nodes (several chains)."""
    edges = gat_edge_index(data.edge_index, data.num_nodes)
    in_degree = degree(edges[1], data.num_nodes)
    test = data.test_mask.nonzero().flatten()
    nodes = test[(in_degree[test] >= 4) & (in_degree[test] <= 8)][: args.diag_nodes].tolist()
    hoods = neighbourhoods(edges.numpy(), nodes)
    layers = attention_site_names(model)

    posterior, prior = [], []
    for chain in range(args.chains):
        seed_everything(1000 + chain)
        with torch.no_grad():
            draws = predictive_draws(
                model, (data.x, data.edge_index), args.samples, layers=layers, with_prior=True,
                select_attention=lambda w: gather(w, hoods), chunk_size=args.chunk,
            )
        posterior.append({layer: w.numpy() for layer, w in draws.attention.items()})
        # the prior's location Psi, normalized over each node's neighbourhood: its prior weights
        prior.append({layer: (p / p.nansum(-1, keepdim=True)).numpy() for layer, p in draws.prior_location.items()})
    idata = attention_inference_data(posterior, queries=nodes, key_node=hoods.sources, prior_chains=prior)
    folder = out / "diagnostics"
    folder.mkdir(parents=True, exist_ok=True)
    idata.to_netcdf(folder / f"{name}.nc")
    summary = attention_summary(idata)
    summary.to_csv(folder / f"{name}-summary.csv")
    info = dict(
        **diagnostics_settings(args), nodes=nodes, entries=len(summary),
        constant_entries=summary.attrs["constant_entries"],
        ess_bulk_min=float(summary["ess_bulk"].min()), r_hat_max=float(summary["r_hat"].max()),
    )
    (folder / f"{name}-diagnostics.json").write_text(json.dumps(info, indent=1))
    neighbourhood_forest(idata, layers[0], nodes[0], out / "figures" / f"{name}-forest.png")
    prior_posterior(idata, layers[-1], nodes[0], 0, out / "figures" / f"{name}-prior-posterior.png")


def require_recorded_settings(files: Iterable[tuple[Path, dict]]) -> None:
    """Finished rows and diagnoses are reused only if they were made with the settings asked for:
    raise, naming the settings that differ, for any existing (file, settings asked for) that was not."""
    for file, settings in files:
        if not file.exists():
            continue
        differing = setting_differences(json.loads(file.read_text()), settings)
        if differing:
            raise ValueError(f"{file} holds a run with other or unrecorded settings: {'; '.join(differing)}. "
                             "Choose another --out for the new settings.")


def run_all(args: argparse.Namespace) -> None:
    out = Path(args.out)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    for dataset in args.dataset or list(NAMES):
        try:
            data, num_features, num_classes = load_planetoid(dataset, args.data_root)
        except FileNotFoundError as error:
            if args.dataset:  # asked for by name: its data must be there
                raise
            print(f"skipping {dataset}: {error}", flush=True)
            continue
        for variant in args.variant:
            for seed in args.seeds:
                first = seed == args.seeds[0]
                files = {m: out / "rows" / f"{dataset}-{variant}-{seed}-{m.replace('+', '-')}.json" for m in modes_for(variant, first)}
                settings = settings_for(dataset, variant, seed, {"max_epochs": args.max_epochs})
                finished = [(file, {**settings.row(), **sampling_settings(mode, args)}) for mode, file in files.items()]
                diag_file = out / "diagnostics" / f"{dataset}-wc-diagnostics.json"
                if variant == "wc" and first:
                    finished.append((diag_file, diagnostics_settings(args)))
                require_recorded_settings(finished)
                diag = variant == "wc" and first and not diag_file.exists()
                if all(f.exists() for f in files.values()) and not diag:
                    continue
                checkpoint = out / "checkpoints" / f"{dataset}-{variant}-{seed}-{settings_digest(settings.row())}.pt"
                model, row = train_node_classifier(settings, data, num_features, num_classes, checkpoint, progress=False)
                for mode, file in files.items():
                    if file.exists():
                        continue
                    metrics, mean_probs = score_run(model, data, mode, args, seed)
                    np.save(file.with_suffix(".npy"), mean_probs)
                    file.write_text(json.dumps({**row, **metrics}))
                    print(f"{dataset:8s} {variant:4s} seed {seed} {mode:17s} acc {row['test_acc']:.2f} "
                          f"NLL {metrics['nll']:.3f} ECE {metrics['ece']:.2f} PAvPU@0.05 {metrics['pavpu@0.05']:.2f} "
                          f"({row['seconds']:.0f}s train, {metrics['sample_seconds']:.1f}s sampling)", flush=True)
                if diag:
                    attention_diagnostics(model, data, out, args, f"{dataset}-wc")


def load_rows(out: Path) -> pd.DataFrame:
    rows = [json.loads(f.read_text()) for f in sorted((out / "rows").glob("*.json"))]
    if not rows:
        raise FileNotFoundError(f"no finished runs in {out / 'rows'}")
    return pd.DataFrame(rows)


def results_table(results: pd.DataFrame) -> pd.DataFrame:
    """Mean +- std over seeds per (dataset, variant, mode), next to the paper's accuracy."""
    order = {v: i for i, v in enumerate(VARIANTS)}
    results = results.assign(_o=results.variant.map(order)).sort_values(["dataset", "_o", "mode"], kind="stable")
    grouped = results.groupby(["dataset", "variant", "mode"], sort=False)
    table = grouped.size().rename("seeds").reset_index()
    table["paper_acc"] = [PAPER_ACCURACY[d][v] for d, v in zip(table.dataset, table.variant)]
    for metric in METRICS:
        table[f"{metric}_mean"] = grouped[metric].mean().values
        table[f"{metric}_std"] = grouped[metric].std(ddof=1).values  # NaN for a single seed
    table["samples"] = grouped["samples"].first().values
    table["uncertainty_from"] = table["mode"].map(MODE_NOTE)
    return table


def markdown(table: pd.DataFrame) -> str:
    shown = table[["dataset", "variant", "mode", "seeds", "samples", "paper_acc"]].copy()
    digits = {"nll": 3, "brier": 3, "entropy": 3, "mutual_info": 4}
    for metric in METRICS:
        d = digits.get(metric, 2)
        shown[metric] = [format_mean_std(m, s, d) for m, s in zip(table[f"{metric}_mean"], table[f"{metric}_std"])]
    notes = "\n".join(f"- mode `{m}`: uncertainty from {n}" for m, n in MODE_NOTE.items())
    return (
        shown.to_markdown(index=False)
        + "\n\ntest_acc: posterior-mean prediction (soft attention weights in eval mode), %; paper_acc: "
        "the paper's Table 1. NLL, Brier, ECE (15 equal-width bins, %), entropy, mutual information (nats) "
        "and PAvPU (%, Student t-test between the top-two classes at p < 0.01 / 0.05 / 0.1) are computed "
        "on the test nodes from the mean of the posterior samples. The soft variant's uncertainty comes "
        "from MC dropout, as in the paper.\n" + notes + "\n"
    )


def write_tables(out: Path) -> pd.DataFrame:
    results = load_rows(out)
    results.to_csv(out / "results.csv", index=False)
    table = results_table(results)
    table.to_csv(out / "table.csv", index=False)
    (out / "table.md").write_text(markdown(table))
    figures = out / "figures"
    for dataset in table.dataset.unique():
        graph = load_planetoid(dataset, _data_root(out))[0]
        labels = graph.y[graph.test_mask].numpy()
        rows = table[table.dataset == dataset]
        variant_comparison(rows.assign(variant=rows.variant + "/" + rows["mode"]), ["test_acc", "ece", "pavpu@0.05"], figures / f"{dataset}-variants.png")
        curves = {}
        for variant, mode in (("soft", "dropout"), ("wc", "attention"), ("wc", "attention+dropout")):
            matches = results[(results.dataset == dataset) & (results.variant == variant) & (results["mode"] == mode)]
            if not matches.empty:
                seed = int(matches.seed.min())
                probs = np.load(out / "rows" / f"{dataset}-{variant}-{seed}-{mode.replace('+', '-')}.npy")
                curves[f"{variant} ({mode}, seed {seed})"] = reliability(probs, labels)
        if curves:
            reliability_diagram(curves, figures / f"{dataset}-reliability.png", title=f"{NAMES[dataset]} test nodes")
    training_curves(*read_runs([out]), figures / "training-curves.png")
    return table


def record_data_root(out: Path, args: argparse.Namespace) -> None:
    """``<out>/settings.json``: the data root, for the tables' labels (the folder's rows record
    every training setting, and a finished run is reused only with the same settings)."""
    path = out / "settings.json"
    recorded = json.loads(path.read_text()) if path.exists() else {}
    data_root = os.path.abspath(args.data_root) if args.data_root is not None else recorded.get("data_root")
    path.write_text(json.dumps({"data_root": data_root}))


def _data_root(out: Path) -> Optional[str]:
    settings = out / "settings.json"
    return json.loads(settings.read_text()).get("data_root") if settings.exists() else None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", nargs="+", default=None, choices=sorted(NAMES),
                   help="default: every Planetoid graph whose data is present under the data root")
    p.add_argument("--variant", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--seeds", nargs="+", type=whole_number(0), default=[0, 1, 2])
    p.add_argument("--samples", type=whole_number(2), default=100, help="posterior draws M per run (the t-test of PAvPU needs 2)")
    p.add_argument("--chunk", type=whole_number(1), default=100, help="draws per vectorized pass (attention noise)")
    p.add_argument("--dropout-chunk", type=whole_number(1), default=10, help="draws per pass with MC dropout (inputs are copied per draw)")
    p.add_argument("--chains", type=whole_number(1), default=4, help="independent chains for the ArviZ diagnostics")
    p.add_argument("--diag-nodes", type=whole_number(1), default=3, help="test nodes whose attention is diagnosed")
    p.add_argument("--max-epochs", type=whole_number(1), default=None, help="training epochs at most (default: the preset's)")
    p.add_argument("--data-root", default=None)
    p.add_argument("--out", default="runs/graph")
    p.add_argument("--threads", type=whole_number(1), default=1)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> pd.DataFrame:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_data_root(out, args)
    run_all(args)
    table = write_tables(out)
    print((out / "table.md").read_text())
    return table


if __name__ == "__main__":
    main()
