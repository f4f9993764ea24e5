"""Uncertainty metrics of classifiers, from probabilities or posterior samples of them.

Shapes: ``probs`` ``[items, classes]`` (one predictive distribution per item, e.g. the mean of
the posterior samples); ``samples`` ``[draws, items, classes]``; ``labels`` ``[items]`` integer
classes; ``accuracy`` ``[items]`` in [0, 1] (may be fractional, as VQA's soft accuracy).
Entropies are in nats. Inputs may be NumPy arrays or torch tensors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from .optional import require

#: p-value thresholds of the paper's PAvPU table (appendix B.2.1)
PAVPU_THRESHOLDS = (0.01, 0.05, 0.1)
_EPS = 1e-12


def _array(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def check_probs(probs, name: str = "probs", atol: float = 1e-4) -> np.ndarray:
    """``probs`` as float64, after checking it holds distributions over the last axis."""
    p = _array(probs)
    if p.ndim < 1 or p.shape[-1] < 2:
        raise ValueError(f"{name} must have a class axis of size >= 2 last, got shape {p.shape}")
    if not np.isfinite(p).all() or (p < -atol).any() or (p > 1 + atol).any():
        raise ValueError(f"{name} must hold finite probabilities in [0, 1]")
    worst = np.abs(p.sum(-1) - 1).max(initial=0.0)
    if worst > atol:
        raise ValueError(f"{name} must sum to one over the last axis (off by up to {worst:.3g})")
    return p


def _labels(labels, probs: np.ndarray) -> np.ndarray:
    y = np.asarray(labels.detach().cpu().numpy() if hasattr(labels, "detach") else labels)
    if y.shape != probs.shape[:-1]:
        raise ValueError(f"labels of shape {y.shape} do not match probs of shape {probs.shape}")
    if not np.issubdtype(y.dtype, np.integer) or (y < 0).any() or (y >= probs.shape[-1]).any():
        raise ValueError(f"labels must be integers in [0, {probs.shape[-1]})")
    return y


def _samples(samples) -> np.ndarray:
    s = check_probs(samples, "samples")
    if s.ndim != 3:
        raise ValueError(f"samples must have shape [draws, items, classes], got {s.shape}")
    return s


def accuracy(probs, labels) -> float:
    """Fraction of items whose most probable class is the label."""
    p = check_probs(probs)
    return float((p.argmax(-1) == _labels(labels, p)).mean())


def nll(probs, labels) -> float:
    """Mean negative log-likelihood of the labels, ``-mean log p[label]``."""
    p = check_probs(probs)
    y = _labels(labels, p)
    return float(-np.log(np.take_along_axis(p, y[..., None], -1).clip(min=_EPS)).mean())


def brier(probs, labels) -> float:
    """Mean over items of the squared distance to the one-hot label (0 best, 2 worst)."""
    p = check_probs(probs)
    onehot = np.eye(p.shape[-1])[_labels(labels, p)]
    return float(((p - onehot) ** 2).sum(-1).mean())


@dataclass
class Reliability:
    """Per equal-width confidence bin: item count, mean confidence and accuracy (NaN if empty)."""

    edges: np.ndarray
    counts: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray

    @property
    def ece(self) -> float:
        """Expected calibration error: sum over bins of (count / n) * |accuracy - confidence|."""
        filled = self.counts > 0
        gaps = np.abs(self.accuracy[filled] - self.confidence[filled])
        return float((self.counts[filled] * gaps).sum() / self.counts.sum())


def reliability(probs, labels, bins: int = 15) -> Reliability:
    """Confidence (top probability) vs accuracy in ``bins`` equal-width bins ``(i/B, (i+1)/B]``.
    Written here rather than with scikit-learn's ``calibration_curve``, which drops empty bins and
    returns no counts: ECE weights each bin by its count."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    p = check_probs(probs)
    correct = p.argmax(-1) == _labels(labels, p)
    conf = p.max(-1).reshape(-1)
    correct = correct.reshape(-1)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.ceil(conf * bins).astype(int) - 1, 0, bins - 1)
    counts = np.bincount(which, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        confidence = np.bincount(which, conf, bins) / counts
        acc = np.bincount(which, correct.astype(float), bins) / counts
    return Reliability(edges, counts, confidence, acc)


def expected_calibration_error(probs, labels, bins: int = 15) -> float:
    """ECE over ``bins`` equal-width confidence bins (:func:`reliability`)."""
    return reliability(probs, labels, bins).ece


def adaptive_calibration_error(probs, labels, bins: int = 15) -> float:
    """ECE over ``bins`` equal-mass bins (adaptive ECE, Nixon et al., 2019): items sorted by
    confidence and split into bins of sizes that differ by at most one, so that no bin is empty
    and confident models are not judged on a handful of bins near 1."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    p = check_probs(probs)
    correct = (p.argmax(-1) == _labels(labels, p)).reshape(-1).astype(float)
    conf = p.max(-1).reshape(-1)
    order = np.argsort(conf, kind="stable")
    gaps = [abs(correct[b].mean() - conf[b].mean()) * b.size for b in np.array_split(order, bins) if b.size]
    return float(sum(gaps) / conf.size)


def max_probability(probs) -> np.ndarray:
    """The top probability of each distribution: the confidence of soft attention's usual score."""
    return check_probs(probs).max(-1)


def entropy(probs) -> np.ndarray:
    """Entropy of each distribution over the last axis."""
    p = check_probs(probs)
    return -(p * np.log(p.clip(min=_EPS))).sum(-1)


def predictive_entropy(samples) -> np.ndarray:
    """``H[mean_m p_m]`` per item: total uncertainty."""
    return entropy(_samples(samples).mean(0))


def mutual_information(samples) -> np.ndarray:
    """``H[mean_m p_m] - mean_m H[p_m]`` per item: the epistemic part (BALD), >= 0."""
    s = _samples(samples)
    return np.maximum(entropy(s.mean(0)) - entropy(s).mean(0), 0.0)


def top_two_pvalues(samples, atol: float = 1e-6) -> np.ndarray:
    """p-value per item of a two-sample t-test between the draws of the two most probable classes
    (by posterior mean), as in the paper's appendix B.2.1.

    Student's test (``equal_var=True``): both classes have the same number of draws, so its t
    statistic equals Welch's and only the degrees of freedom (2M - 2) differ. Draws that are
    constant in both classes (spread <= ``atol``: float32 noise counts as constant) make the test
    undefined or numerically meaningless; the answer is then exact: p = 0 if the two means
    differ by more than ``atol`` (certain), p = 1 if not.
    """
    s = _samples(samples)
    if s.shape[0] < 2:
        raise ValueError("the t-test needs at least 2 draws")
    order = np.argsort(-s.mean(0), axis=-1)
    first = np.take_along_axis(s, order[None, :, :1], -1)[..., 0]
    second = np.take_along_axis(s, order[None, :, 1:2], -1)[..., 0]
    constant = (np.ptp(first, 0) <= atol) & (np.ptp(second, 0) <= atol)
    same = np.abs(first.mean(0) - second.mean(0)) <= atol
    pvalues = np.where(constant, same.astype(float), np.nan)
    varying = ~constant
    if varying.any():
        with warnings.catch_warnings():
            # one class may be exactly constant while the other varies: its own variance is 0,
            # which scipy flags as "precision loss", but the pooled variance of the test is fine
            warnings.filterwarnings("ignore", "Precision loss", RuntimeWarning)
            stats = require("scipy.stats", "bam_pyro.metrics.top_two_pvalues")
            pvalues[varying] = stats.ttest_ind(first[:, varying], second[:, varying], axis=0, equal_var=True).pvalue
    return pvalues


@dataclass
class PAvPU:
    """Counts of accurate/inaccurate x certain/uncertain items (fractional with soft accuracy)."""

    accurate_certain: float
    accurate_uncertain: float
    inaccurate_certain: float
    inaccurate_uncertain: float

    @property
    def value(self) -> float:
        total = self.accurate_certain + self.accurate_uncertain + self.inaccurate_certain + self.inaccurate_uncertain
        return (self.accurate_certain + self.inaccurate_uncertain) / total


def pavpu_counts(accuracy, certain) -> PAvPU:
    """PAvPU counts from per-item accuracy in [0, 1] and certainty indicators."""
    acc = _array(accuracy).reshape(-1)
    cer = np.asarray(certain, dtype=bool).reshape(-1).astype(float)
    if acc.shape != cer.shape or acc.size == 0:
        raise ValueError(f"accuracy ({acc.size}) and certain ({cer.size}) need the same, non-zero length")
    if (acc < 0).any() or (acc > 1).any():
        raise ValueError("accuracy must lie in [0, 1]")
    return PAvPU(
        float((acc * cer).sum()), float((acc * (1 - cer)).sum()),
        float(((1 - acc) * cer).sum()), float(((1 - acc) * (1 - cer)).sum()),
    )


def pavpu(samples, accuracy, threshold: float = 0.05) -> float:
    """Patch accuracy vs patch uncertainty: an item is certain when the top-two t-test gives
    p < ``threshold``. ``accuracy``: per item, of the posterior-mean prediction."""
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must lie in (0, 1), got {threshold}")
    return pavpu_counts(accuracy, top_two_pvalues(samples) < threshold).value


def sample_metrics(samples, labels, bins: int = 15) -> dict[str, float]:
    """Every metric of one set of posterior samples; the prediction is the posterior mean."""
    s = _samples(samples)
    mean = s.mean(0)
    correct = mean.argmax(-1) == _labels(labels, mean)
    pvalues = top_two_pvalues(s)
    row = dict(
        accuracy=accuracy(mean, labels), nll=nll(mean, labels), brier=brier(mean, labels),
        ece=expected_calibration_error(mean, labels, bins),
        entropy=float(predictive_entropy(s).mean()), mutual_info=float(mutual_information(s).mean()),
    )
    for t in PAVPU_THRESHOLDS:
        row[f"pavpu@{t:g}"] = pavpu_counts(correct, pvalues < t).value
    return row


#: metrics of :func:`sample_metrics` that tables show in percent
PERCENT_METRICS = ("accuracy", "ece", *(f"pavpu@{t:g}" for t in PAVPU_THRESHOLDS))


def uncertainty_report(samples, labels, prefix: str = "", bins: int = 15) -> dict[str, float]:
    """:func:`sample_metrics` in the units the tables show (accuracy, ECE and PAvPU in percent),
    each name prefixed with ``prefix``."""
    row = sample_metrics(samples, labels, bins)
    return {prefix + name: 100 * value if name in PERCENT_METRICS else value for name, value in row.items()}
