"""The uncertainty-under-shift tables, for any task: eight methods scored from the same runs'
``shift.npz`` (:mod:`experiments.runner.shift_draws`), mean ± std over seeds, and paired differences.
A task declares its evaluation sets (:class:`ShiftStudy`); everything else is here.

Methods, per seed ``k`` (every method over the seeds that have an ensemble):

- ``soft``: soft attention's deterministic prediction; ``temperature``: the same logits divided by
  a temperature fitted on the run's held-out labels (:func:`bam_pyro.shift.fit_temperature`);
- ``MC dropout``: soft attention's draws with its dropout on;
- ``ensemble``: the mean of :data:`ENSEMBLE` soft runs' predictions, seeds ``k .. k + 4``, from their
  saved logits (no retraining);
- ``BAM-WC``, ``BAM-LC``: the posterior predictive of attention noise (network in eval mode), and
  ``+ dropout``: attention noise and MC dropout together.

Scores (higher: less certain): ``1 - max p``, the predictive ``entropy``, and for the methods that
average several predictions the mutual information ``MI`` between prediction and draw (BALD).
Metrics are percentages. Detection tells a shifted or out-of-distribution set's items from the
in-distribution set ``id``'s by the score (AUROC, FPR95, and AUPR-out for a set of novel inputs).
A shifted set (:attr:`EvaluationSet.labelled`) has labels of the training classes: accuracy, ECE
and selective prediction (AURC) of its own. A set of novel inputs may also be pooled with ``id``
for selective prediction, its items counted as errors (``abstain_with_id``): the score should send
them to abstention first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import pandas as pd
from scipy.special import softmax

from analysis.plots import reliability_diagram, risk_coverage_curves
from analysis.tables import paired_difference, summarize
from bam_pyro.metrics import entropy, expected_calibration_error, reliability
from bam_pyro.shift import RiskCoverage, fit_temperature, ood_detection, risk_coverage
from experiments.records import RunFolder, read_arrays
from experiments.runner.shift_draws import SHIFT_FILE
from experiments.runner.task import Task

#: soft runs pooled by the deep ensemble
ENSEMBLE = 5
#: method -> (variant of its runs, sampling mode; None: the deterministic logits)
SAMPLED = {"MC dropout": ("soft", "mc_dropout"), "BAM-WC": ("wc", "attention"), "BAM-WC + dropout": ("wc", "attention_dropout"),
           "BAM-LC": ("lc", "attention"), "BAM-LC + dropout": ("lc", "attention_dropout")}
METHODS = ("soft", "temperature", "MC dropout", "ensemble", *list(SAMPLED)[1:])
BASELINES = ("soft", "MC dropout", "ensemble")
#: the score the paired differences compare (the one every method has)
PAIRED_SCORE = "entropy"
#: the names of the tables :meth:`ShiftStudy.tables` makes, as the tasks publish them
TABLES = ("detection", "calibration", "paired")


@dataclass(frozen=True)
class EvaluationSet:
    """One set of a run's ``shift.npz``: ``name`` there, ``label`` in the tables' columns and the
    figures. ``labelled``: its items carry labels of the training classes (``id``, or a shifted
    copy of it); otherwise they are novel inputs, with no label the classifier could give.
    ``suffix``: what its detection columns end in (default ``" <label>"``). ``abstain_with_id``
    (novel sets): selective prediction on ``id`` and this set pooled, its items counted wrong."""

    name: str
    label: str
    labelled: bool = True
    suffix: Optional[str] = None
    abstain_with_id: bool = False

    @property
    def columns(self) -> str:
        return f" {self.label}" if self.suffix is None else self.suffix


#: the in-distribution set every other set is detected against
ID = EvaluationSet("id", "ID")


@dataclass(frozen=True)
class Prediction:
    """A method's prediction on one set: mean class probabilities, the labels (None for novel
    inputs), and the mutual information where predictions were averaged (None for a deterministic one)."""

    probs: np.ndarray
    labels: Optional[np.ndarray]
    mutual_info: Optional[np.ndarray] = None

    def scores(self) -> dict[str, np.ndarray]:
        """Uncertainty scores by name (MI only where predictions were averaged)."""
        found = {"1 - max p": 1 - self.probs.max(-1), "entropy": entropy(self.probs)}
        if self.mutual_info is not None:
            found["MI"] = self.mutual_info
        return found

    @property
    def correct(self) -> np.ndarray:
        if self.labels is None:
            raise ValueError("a prediction of novel inputs has no labels to be right or wrong about")
        return (self.probs.argmax(-1) == self.labels).astype(float)


def _labels(labels: Optional[np.ndarray]) -> Optional[np.ndarray]:
    return None if labels is None else labels.astype(int)


def deterministic(logits: np.ndarray, labels: Optional[np.ndarray], temperature: float = 1.0) -> Prediction:
    """The prediction of saved logits, divided by ``temperature``."""
    return Prediction(softmax(logits.astype(np.float64) / temperature, axis=-1), _labels(labels))


def sampled(arrays: dict[str, np.ndarray], name: str, mode: str) -> Prediction:
    """The saved mean of a sampling mode's draws on set ``name`` (renormalized from float16)."""
    probs = arrays[f"{name}.{mode}.probs"].astype(np.float64)
    return Prediction(probs / probs.sum(-1, keepdims=True), _labels(arrays.get(f"{name}.labels")),
                      arrays[f"{name}.{mode}.mutual_info"].astype(np.float64))


def pooled(members: list[Prediction]) -> Prediction:
    """The ensemble of ``members``: their mean probabilities; its MI is the entropy of the mean
    less the members' mean entropy."""
    probs = np.mean([m.probs for m in members], 0)
    mutual_info = np.maximum(entropy(probs) - np.mean([entropy(m.probs) for m in members], 0), 0.0)
    return Prediction(probs, members[0].labels, mutual_info)


def read_shift(folder: RunFolder, run: str, sets: tuple[EvaluationSet, ...], modes: list[str]) -> dict[str, np.ndarray]:
    """The arrays of run ``run``'s ``shift.npz`` that ``sets`` and ``modes`` need (a soft run's
    logits besides its draws; labels of the labelled sets only)."""
    names = [f"{s.name}.labels" for s in sets if s.labelled]
    names += [f"{s.name}.{m}.{part}" for s in sets for m in modes for part in ("probs", "mutual_info")]
    if "mc_dropout" in modes:
        names += ["val.logits", "val.labels", *(f"{s.name}.logits" for s in sets)]
    return read_arrays(folder.run_dir(run) / SHIFT_FILE, names)


def abstaining_on_both(clean: Prediction, novel: Prediction, score: str) -> RiskCoverage:
    """Selective prediction on ``clean``'s items and ``novel``'s pooled, every novel item counted wrong."""
    return risk_coverage(np.concatenate([clean.scores()[score], novel.scores()[score]]),
                         np.concatenate([clean.correct, np.zeros(novel.probs.shape[0])]))


#: (panel, the shown set) -> a figure's title
Title = Callable[[str, EvaluationSet], str]


@dataclass(frozen=True)
class ShiftStudy:
    """A task's uncertainty-under-shift study: ``panel``, the results' column that names the runs'
    data set (``<panel>-<variant>-seed<k>`` is a run's name); ``sets``, a panel's runs -> its
    evaluation sets, :data:`ID` first; ``shown``, a panel's runs -> the name of the set the figures
    show (a novel set's risk-coverage curve is pooled with ``id``); the figures' titles."""

    panel: str
    sets: Callable[[pd.DataFrame], tuple[EvaluationSet, ...]]
    shown: Callable[[pd.DataFrame], str]
    risk_coverage_title: Title
    reliability_title: Title

    def predictions(self, results: pd.DataFrame, folder: RunFolder) -> Iterator[tuple[str, str, int, dict[str, Prediction]]]:
        """``(panel, method, seed, {set: prediction})`` of every method and seed with an ensemble."""
        for panel, runs in results.groupby(self.panel, sort=False):
            sets = self.sets(runs)
            arrays = {(row.variant, int(row.seed)): read_shift(folder, f"{panel}-{row.variant}-seed{row.seed}", sets,
                                                              [m for v, m in SAMPLED.values() if v == row.variant])
                      for row in runs.itertuples()}
            soft = {seed: {s.name: deterministic(a[f"{s.name}.logits"], a.get(f"{s.name}.labels")) for s in sets}
                    for (variant, seed), a in arrays.items() if variant == "soft"}
            for seed in sorted(k for k in soft if all(k + i in soft for i in range(ENSEMBLE))):
                a = arrays[("soft", seed)]
                temperature = fit_temperature(a["val.logits"].astype(np.float64), a["val.labels"])
                yield panel, "soft", seed, soft[seed]
                yield panel, "temperature", seed, {s.name: deterministic(a[f"{s.name}.logits"], a.get(f"{s.name}.labels"), temperature)
                                                   for s in sets}
                yield panel, "ensemble", seed, {s.name: pooled([soft[seed + i][s.name] for i in range(ENSEMBLE)]) for s in sets}
                for method, (variant, mode) in SAMPLED.items():
                    if (variant, seed) in arrays:
                        yield panel, method, seed, {s.name: sampled(arrays[(variant, seed)], s.name, mode) for s in sets}

    def run_metrics(self, results: pd.DataFrame, folder: RunFolder) -> pd.DataFrame:
        """One row per (panel, method, score, seed): every detection, selective-prediction and
        calibration figure (%) of the run's sets; calibration repeats on each score's row."""
        sets = {panel: self.sets(runs) for panel, runs in results.groupby(self.panel, sort=False)}
        rows = []
        for panel, method, seed, by_set in self.predictions(results, folder):
            clean = by_set[ID.name]
            calibration = {}
            for s in (s for s in sets[panel] if s.labelled):
                prediction = by_set[s.name]
                calibration[f"acc {s.label}"] = 100 * prediction.correct.mean()
                calibration[f"ECE {s.label}"] = 100 * expected_calibration_error(prediction.probs, prediction.labels)
            for score, clean_scores in clean.scores().items():
                row = {self.panel: panel, "method": method, "score": score, "seed": seed, **calibration}
                for s in sets[panel]:
                    prediction = by_set[s.name]
                    scores = prediction.scores()[score]
                    if s.name == ID.name:
                        row[f"AURC {s.label}"] = 100 * risk_coverage(scores, prediction.correct).aurc
                        continue
                    detection = ood_detection(clean_scores, scores)
                    row.update({f"AUROC{s.columns}": 100 * detection.auroc, f"FPR95{s.columns}": 100 * detection.fpr95})
                    if s.labelled:
                        row[f"AURC {s.label}"] = 100 * risk_coverage(scores, prediction.correct).aurc
                        continue
                    row[f"AUPR-out{s.columns}"] = 100 * detection.aupr_out
                    if s.abstain_with_id:
                        row[f"AURC ID+{s.label}"] = 100 * abstaining_on_both(clean, prediction, score).aurc
                rows.append(row)
        return pd.DataFrame(rows)

    def tables(self, results: pd.DataFrame, folder: RunFolder) -> dict[str, pd.DataFrame]:
        """The tables of one folder's runs: ``detection``, ``calibration`` and ``paired`` (differences
        in every AUROC, and in the AURC of ``id`` pooled with novel items if there is one, else of
        the last set with an AURC)."""
        metrics = self.run_metrics(results, folder)
        shifted = [c for c in metrics if c.startswith("AUROC")]
        pooled_aurc = [c for c in metrics if c.startswith("AURC ID+")]
        aurc = pooled_aurc[0] if pooled_aurc else [c for c in metrics if c.startswith("AURC")][-1]
        return {"detection": detection_table(metrics, self.panel), "calibration": calibration_table(metrics, self.panel),
                "paired": paired_table(metrics, [*shifted, aurc], self.panel)}

    def first_seed(self, results: pd.DataFrame, folder: RunFolder, panel: str) -> dict[str, dict[str, Prediction]]:
        """Every method's predictions of ``panel``'s first seed (the figures' runs)."""
        found = [(method, seed, by_set) for _, method, seed, by_set in self.predictions(results[results[self.panel] == panel], folder)]
        seed = min(s for _, s, _ in found)
        return {method: by_set for method, s, by_set in found if s == seed}

    def _shown(self, results: pd.DataFrame) -> Iterator[tuple[str, EvaluationSet]]:
        for panel, runs in results.groupby(self.panel, sort=False):
            name = self.shown(runs)
            yield panel, next(s for s in self.sets(runs) if s.name == name)

    def risk_coverage_figures(self, task: Task, results: pd.DataFrame, folder: RunFolder, path: Path) -> list[Path]:
        """Risk-coverage curves per panel (``<stem>_<panel>.png``) of the first seed, ranked by
        :data:`PAIRED_SCORE`, on the shown set (a novel one pooled with ``id``, counted wrong)."""
        written = []
        for panel, shown in self._shown(results):
            curves = {}
            for method, by_set in self.first_seed(results, folder, panel).items():
                if shown.labelled:
                    curves[method] = risk_coverage(by_set[shown.name].scores()[PAIRED_SCORE], by_set[shown.name].correct)
                else:
                    curves[method] = abstaining_on_both(by_set[ID.name], by_set[shown.name], PAIRED_SCORE)
            written.append(risk_coverage_curves(curves, path.with_name(f"{path.stem}_{panel}{path.suffix}"),
                                                title=self.risk_coverage_title(panel, shown)))
        return written

    def reliability_figures(self, task: Task, results: pd.DataFrame, folder: RunFolder, path: Path) -> list[Path]:
        """Reliability diagrams per panel of the first seed on the shown set (a labelled one)."""
        written = []
        for panel, shown in self._shown(results):
            curves = {method: reliability(by_set[shown.name].probs, by_set[shown.name].labels)
                      for method, by_set in self.first_seed(results, folder, panel).items()}
            written.append(reliability_diagram(curves, path.with_name(f"{path.stem}_{panel}{path.suffix}"),
                                               title=self.reliability_title(panel, shown)))
        return written


def _in_method_order(table: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    rank = {m: i for i, m in enumerate(METHODS)}
    order = sorted(range(len(table)), key=lambda i: rank[table.index[i][by.index("method")]])
    return table.iloc[order].reset_index()


def detection_table(metrics: pd.DataFrame, panel: str) -> pd.DataFrame:
    """Per panel, method and score: mean ± std over seeds of detection and AURC."""
    columns = [c for c in metrics if c.startswith(("AUROC", "AUPR", "FPR95", "AURC"))]
    by = [panel, "method", "score"]
    return _in_method_order(summarize(metrics, by, columns), by)


def calibration_table(metrics: pd.DataFrame, panel: str) -> pd.DataFrame:
    """Per panel and method: accuracy and ECE on each labelled set (mean ± std over seeds)."""
    columns = [c for c in metrics if c.startswith(("acc", "ECE"))]
    rows = metrics[metrics["score"] == PAIRED_SCORE]
    return _in_method_order(summarize(rows, [panel, "method"], columns), [panel, "method"])


def paired_table(metrics: pd.DataFrame, columns: list[str], panel: str) -> pd.DataFrame:
    """Per panel, BAM method and baseline: the paired difference (same seed) of each of
    ``columns`` under :data:`PAIRED_SCORE`, mean ± std and 95% interval."""
    runs = metrics[metrics["score"] == PAIRED_SCORE].rename(columns={"method": "variant"})
    if not runs["variant"].isin(METHODS[4:]).any():  # no BAM run yet: the table's header alone
        return pd.DataFrame(columns=[panel, "method", "baseline", "n", *columns])
    parts = []
    for baseline in BASELINES:
        kept = runs[runs["variant"].isin([baseline, *METHODS[4:]])]
        table = pd.concat([paired_difference(kept, [panel], c, baseline=baseline)[c] for c in columns], axis=1)
        n = paired_difference(kept, [panel], columns[0], baseline=baseline)["n"]
        parts.append(table.assign(baseline=baseline, n=n).set_index("baseline", append=True))
    table = pd.concat(parts).rename_axis([panel, "method", "baseline"])
    table = table[["n", *columns]]
    rank = {m: i for i, m in enumerate(METHODS)}
    order = sorted(range(len(table)), key=lambda i: (rank[table.index[i][1]], BASELINES.index(table.index[i][2])))
    return table.iloc[order].reset_index()
