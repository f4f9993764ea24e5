"""The uncertainty-under-shift tables of the GAT runs: eight methods scored from the same runs'
``shift.npz`` (:mod:`experiments.gat.ood`), mean ± std over seeds, and paired differences.

Methods, per seed ``k`` (every method over the seeds that have an ensemble):

- ``soft``: soft attention's deterministic prediction; ``temperature``: the same logits divided by
  a temperature fitted on the run's validation nodes (:func:`bam_pyro.shift.fit_temperature`);
- ``MC dropout``: soft attention's draws with its dropout on;
- ``ensemble``: the mean of :data:`ENSEMBLE` soft runs' predictions, seeds ``k .. k + 4``, from their
  saved logits (no retraining);
- ``BAM-WC``, ``BAM-LC``: the posterior predictive of attention noise (network in eval mode), and
  ``+ dropout``: attention noise and MC dropout together.

Scores (higher: less certain): ``1 - max p``, the predictive ``entropy``, and for the methods that
average several predictions the mutual information ``MI`` between prediction and draw (BALD).
Metrics are percentages. On the word-flipped sets, detection tells each test node's flipped copy
from its clean one; on the left-out sets, the left-out classes' test nodes from the kept ones'.
Selective prediction on ``ID+OOD`` counts every left-out node as an error: the score should send
them to abstention first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pandas as pd
from scipy.special import softmax

from analysis.plots import reliability_diagram, risk_coverage_curves
from analysis.tables import paired_difference, summarize
from bam_pyro.metrics import entropy, expected_calibration_error, reliability
from bam_pyro.shift import fit_temperature, ood_detection, risk_coverage
from experiments.gat.ood import SHIFT_FILE, evaluation_set_names
from experiments.records import RunFolder, read_arrays
from experiments.runner import Task

#: soft runs pooled by the deep ensemble
ENSEMBLE = 5
#: method -> (variant of its runs, sampling mode; None: the deterministic logits)
SAMPLED = {"MC dropout": ("soft", "mc_dropout"), "BAM-WC": ("wc", "attention"), "BAM-WC + dropout": ("wc", "attention_dropout"),
           "BAM-LC": ("lc", "attention"), "BAM-LC + dropout": ("lc", "attention_dropout")}
METHODS = ("soft", "temperature", "MC dropout", "ensemble", *list(SAMPLED)[1:])
BASELINES = ("soft", "MC dropout", "ensemble")
#: the score the paired differences compare (the one every method has)
PAIRED_SCORE = "entropy"
#: the shifted set the figures show
FIGURE_FLIP = "flip0.05"


@dataclass(frozen=True)
class Prediction:
    """A method's prediction on one set: mean class probabilities, the labels, and the mutual
    information where predictions were averaged (None for a deterministic one)."""

    probs: np.ndarray
    labels: np.ndarray
    mutual_info: Optional[np.ndarray] = None

    def scores(self) -> dict[str, np.ndarray]:
        """Uncertainty scores by name (MI only where predictions were averaged)."""
        found = {"1 - max p": 1 - self.probs.max(-1), "entropy": entropy(self.probs)}
        if self.mutual_info is not None:
            found["MI"] = self.mutual_info
        return found

    @property
    def correct(self) -> np.ndarray:
        return (self.probs.argmax(-1) == self.labels).astype(float)


def deterministic(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0) -> Prediction:
    """The prediction of saved logits, divided by ``temperature``."""
    return Prediction(softmax(logits.astype(np.float64) / temperature, axis=-1), labels.astype(int))


def sampled(arrays: dict[str, np.ndarray], name: str, mode: str) -> Prediction:
    """The saved mean of a sampling mode's draws on set ``name`` (renormalized from float16)."""
    probs = arrays[f"{name}.{mode}.probs"].astype(np.float64)
    return Prediction(probs / probs.sum(-1, keepdims=True), arrays[f"{name}.labels"].astype(int),
                      arrays[f"{name}.{mode}.mutual_info"].astype(np.float64))


def pooled(members: list[Prediction]) -> Prediction:
    """The ensemble of ``members``: their mean probabilities; its MI is the entropy of the mean
    less the members' mean entropy."""
    probs = np.mean([m.probs for m in members], 0)
    mutual_info = np.maximum(entropy(probs) - np.mean([entropy(m.probs) for m in members], 0), 0.0)
    return Prediction(probs, members[0].labels, mutual_info)


def read_shift(folder: RunFolder, run: str, sets: list[str], modes: list[str]) -> dict[str, np.ndarray]:
    """The arrays of run ``run``'s ``shift.npz`` that ``sets`` and ``modes`` need (a soft run's
    logits besides its draws)."""
    names = [f"{s}.labels" for s in sets] + [f"{s}.{m}.{part}" for s in sets for m in modes for part in ("probs", "mutual_info")]
    if "mc_dropout" in modes:
        names += ["val.logits", "val.labels", *(f"{s}.logits" for s in sets)]
    return read_arrays(folder.run_dir(run) / SHIFT_FILE, names)


def predictions(results: pd.DataFrame, folder: RunFolder) -> Iterator[tuple[str, str, int, dict[str, Prediction]]]:
    """``(dataset, method, seed, {set: prediction})`` of every method and seed with an ensemble."""
    for dataset, runs in results.groupby("dataset", sort=False):
        left_out = int(runs["left_out"].iloc[0]) if "left_out" in runs else 0
        sets = evaluation_set_names(left_out)
        arrays = {(row.variant, int(row.seed)): read_shift(folder, f"{dataset}-{row.variant}-seed{row.seed}", sets,
                                                          [m for v, m in SAMPLED.values() if v == row.variant])
                  for row in runs.itertuples()}
        soft = {seed: {s: deterministic(a[f"{s}.logits"], a[f"{s}.labels"]) for s in sets}
                for (variant, seed), a in arrays.items() if variant == "soft"}
        for seed in sorted(k for k in soft if all(k + i in soft for i in range(ENSEMBLE))):
            a = arrays[("soft", seed)]
            temperature = fit_temperature(a["val.logits"].astype(np.float64), a["val.labels"])
            yield dataset, "soft", seed, soft[seed]
            yield dataset, "temperature", seed, {s: deterministic(a[f"{s}.logits"], a[f"{s}.labels"], temperature) for s in sets}
            yield dataset, "ensemble", seed, {s: pooled([soft[seed + i][s] for i in range(ENSEMBLE)]) for s in sets}
            for method, (variant, mode) in SAMPLED.items():
                if (variant, seed) in arrays:
                    yield dataset, method, seed, {s: sampled(arrays[(variant, seed)], s, mode) for s in sets}


def set_label(name: str) -> str:
    """``flip0.05`` -> ``p=0.05``; ``id`` -> ``ID``."""
    return {"id": "ID", "ood": "OOD"}.get(name, name.replace("flip", "p="))


def run_metrics(results: pd.DataFrame, folder: RunFolder) -> pd.DataFrame:
    """One row per (dataset, method, score, seed): every detection, selective-prediction and
    calibration figure (%) of the run's sets; calibration repeats on each score's row."""
    rows = []
    for dataset, method, seed, by_set in predictions(results, folder):
        clean = by_set["id"]
        calibration = {}
        for name, prediction in by_set.items():
            if name != "ood":
                calibration[f"acc {set_label(name)}"] = 100 * prediction.correct.mean()
                calibration[f"ECE {set_label(name)}"] = 100 * expected_calibration_error(prediction.probs, prediction.labels)
        for score, clean_scores in clean.scores().items():
            row = {"dataset": dataset, "method": method, "score": score, "seed": seed, **calibration}
            for name, prediction in by_set.items():
                scores = prediction.scores()[score]
                if name == "id":
                    row["AURC ID"] = 100 * risk_coverage(scores, prediction.correct).aurc
                    continue
                detection = ood_detection(clean_scores, scores)
                label = "" if name == "ood" else f" {set_label(name)}"
                row.update({f"AUROC{label}": 100 * detection.auroc, f"FPR95{label}": 100 * detection.fpr95})
                if name == "ood":
                    row["AUPR-out"] = 100 * detection.aupr_out
                    both = risk_coverage(np.concatenate([clean_scores, scores]), np.concatenate([clean.correct, np.zeros(scores.size)]))
                    row["AURC ID+OOD"] = 100 * both.aurc
                else:
                    row[f"AURC {set_label(name)}"] = 100 * risk_coverage(scores, prediction.correct).aurc
            rows.append(row)
    return pd.DataFrame(rows)


def _in_method_order(table: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    rank = {m: i for i, m in enumerate(METHODS)}
    order = sorted(range(len(table)), key=lambda i: rank[table.index[i][by.index("method")]])
    return table.iloc[order].reset_index()


def detection_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per data set, method and score: mean ± std over seeds of detection and AURC."""
    columns = [c for c in metrics if c.startswith(("AUROC", "AUPR", "FPR95", "AURC"))]
    by = ["dataset", "method", "score"]
    return _in_method_order(summarize(metrics, by, columns), by)


def calibration_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per data set and method: accuracy and ECE on each set (mean ± std over seeds)."""
    columns = [c for c in metrics if c.startswith(("acc", "ECE"))]
    rows = metrics[metrics["score"] == PAIRED_SCORE]
    return _in_method_order(summarize(rows, ["dataset", "method"], columns), ["dataset", "method"])


def paired_table(metrics: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Per data set, BAM method and baseline: the paired difference (same seed) of each of
    ``columns`` under :data:`PAIRED_SCORE`, mean ± std and 95% interval."""
    runs = metrics[metrics["score"] == PAIRED_SCORE].rename(columns={"method": "variant"})
    if not runs["variant"].isin(METHODS[4:]).any():  # no BAM run yet: the table's header alone
        return pd.DataFrame(columns=["dataset", "method", "baseline", "n", *columns])
    parts = []
    for baseline in BASELINES:
        kept = runs[runs["variant"].isin([baseline, *METHODS[4:]])]
        table = pd.concat([paired_difference(kept, ["dataset"], c, baseline=baseline)[c] for c in columns], axis=1)
        n = paired_difference(kept, ["dataset"], columns[0], baseline=baseline)["n"]
        parts.append(table.assign(baseline=baseline, n=n).set_index("baseline", append=True))
    table = pd.concat(parts).rename_axis(["dataset", "method", "baseline"])
    table = table[["n", *columns]]
    rank = {m: i for i, m in enumerate(METHODS)}
    order = sorted(range(len(table)), key=lambda i: (rank[table.index[i][1]], BASELINES.index(table.index[i][2])))
    return table.iloc[order].reset_index()


def shift_tables(results: pd.DataFrame, folder: RunFolder) -> dict[str, pd.DataFrame]:
    """The tables of one folder's runs: ``detection``, ``calibration`` and ``paired`` (differences
    in AUROC and AURC of the most shifted set, or of the left-out classes)."""
    metrics = run_metrics(results, folder)
    shifted = [c for c in metrics if c.startswith("AUROC")]
    aurc = "AURC ID+OOD" if "AURC ID+OOD" in metrics else [c for c in metrics if c.startswith("AURC")][-1]
    return {"detection": detection_table(metrics), "calibration": calibration_table(metrics),
            "paired": paired_table(metrics, [*shifted, aurc])}


def first_seed(results: pd.DataFrame, folder: RunFolder, dataset: str) -> dict[str, dict[str, Prediction]]:
    """Every method's predictions of ``dataset``'s first seed (the figures' runs)."""
    found = [(method, seed, by_set) for d, method, seed, by_set in predictions(results[results["dataset"] == dataset], folder)]
    seed = min(s for _, s, _ in found)
    return {method: by_set for method, s, by_set in found if s == seed}


def risk_coverage_figures(task: Task, results: pd.DataFrame, folder: RunFolder, path: Path) -> list[Path]:
    """Risk-coverage curves per data set (``<stem>_<dataset>.png``) of the first seed, ranked by
    entropy: on the most flipped words, or on ID+OOD nodes with the OOD ones counted wrong."""
    written = []
    for dataset in results["dataset"].unique():
        curves = {}
        for method, by_set in first_seed(results, folder, dataset).items():
            if "ood" in by_set:
                clean, ood = by_set["id"], by_set["ood"]
                curves[method] = risk_coverage(np.concatenate([clean.scores()[PAIRED_SCORE], ood.scores()[PAIRED_SCORE]]),
                                               np.concatenate([clean.correct, np.zeros(ood.labels.size)]))
                title = f"{dataset}: kept and left-out classes' test nodes"
            else:
                shifted = by_set[FIGURE_FLIP]
                curves[method] = risk_coverage(shifted.scores()[PAIRED_SCORE], shifted.correct)
                title = f"{dataset}: test nodes, words flipped at {set_label(FIGURE_FLIP)}"
        written.append(risk_coverage_curves(curves, path.with_name(f"{path.stem}_{dataset}{path.suffix}"), title=title))
    return written


def reliability_figures(task: Task, results: pd.DataFrame, folder: RunFolder, path: Path) -> list[Path]:
    """Reliability diagrams per data set of the first seed on the most flipped words."""
    written = []
    for dataset in results["dataset"].unique():
        curves = {method: reliability(by_set[FIGURE_FLIP].probs, by_set[FIGURE_FLIP].labels)
                  for method, by_set in first_seed(results, folder, dataset).items()}
        written.append(reliability_diagram(curves, path.with_name(f"{path.stem}_{dataset}{path.suffix}"),
                                           title=f"{dataset}: words flipped at {set_label(FIGURE_FLIP)}"))
    return written
