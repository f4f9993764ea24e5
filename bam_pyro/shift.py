"""Uncertainty put to use: flagging out-of-distribution inputs, and abstaining on the least certain.

Both start from one uncertainty score per item, higher meaning less certain: the predictive
entropy or mutual information of posterior draws (:mod:`bam_pyro.metrics`), or ``1 - max p``.

- **Detection** treats the out-of-distribution (OOD) items as the positive class and the score as
  the detector: AUROC, the average precision with OOD positive (AUPR-out) and with in-distribution
  positive on the negated score (AUPR-in), and the false-positive rate on in-distribution items at
  the threshold that flags 95% of the OOD ones (FPR95; Hendrycks et al. call it FAR95). AUROC and
  AUPR are scikit-learn's.
- **Selective prediction** keeps the items with the lowest scores and answers only those. The
  risk-coverage curve gives the error rate among the kept items against the fraction kept; AURC is
  its mean over the ``n`` coverages ``1/n, ..., 1`` (Geifman et al., 2019), so a model that is
  wrong on exactly its most uncertain items gets the least. Ties between scores are broken by
  expectation: an item tied with others contributes their mean error, so the result does not
  depend on the order the items came in.

``correct`` may be fractional (VQA's soft accuracy); the risk of an item is ``1 - correct``.

**Temperature scaling** (Guo et al., 2017), the usual post-hoc fix of a deterministic network's
confidence, divides the logits by one temperature fitted on held-out labels
(:func:`fit_temperature`); it changes confidence, never the predicted class.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .metrics import _array
from .optional import require


def _scores(scores, name: str) -> np.ndarray:
    s = _array(scores).reshape(-1)
    if s.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(s).all():
        raise ValueError(f"{name} must be finite: {int((~np.isfinite(s)).sum())} of {s.size} are not")
    return s


@dataclass(frozen=True)
class Detection:
    """How well a score tells OOD items (positive) from in-distribution ones."""

    auroc: float
    aupr_out: float
    aupr_in: float
    fpr95: float

    def as_row(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{name}": value for name, value in vars(self).items()}


def fpr_at_tpr(in_scores, out_scores, tpr: float = 0.95) -> float:
    """False-positive rate on in-distribution items at the lowest threshold (the first on the ROC
    curve) that flags at least ``tpr`` of the OOD items."""
    if not 0 < tpr <= 1:
        raise ValueError(f"tpr must lie in (0, 1], got {tpr}")
    fprs, tprs = _roc(_scores(in_scores, "in_scores"), _scores(out_scores, "out_scores"))
    return float(fprs[np.searchsorted(tprs, tpr - 1e-12, side="left")])


def _roc(in_scores: np.ndarray, out_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    metrics = require("sklearn.metrics", "bam_pyro.shift")
    labels = np.concatenate([np.zeros(in_scores.size), np.ones(out_scores.size)])
    fprs, tprs, _ = metrics.roc_curve(labels, np.concatenate([in_scores, out_scores]), drop_intermediate=False)
    return fprs, tprs


def ood_detection(in_scores, out_scores) -> Detection:
    """AUROC, AUPR-out, AUPR-in and FPR95 of ``out_scores`` (OOD items) against ``in_scores``."""
    metrics = require("sklearn.metrics", "bam_pyro.shift.ood_detection")
    inside, outside = _scores(in_scores, "in_scores"), _scores(out_scores, "out_scores")
    labels = np.concatenate([np.zeros(inside.size), np.ones(outside.size)])
    scores = np.concatenate([inside, outside])
    return Detection(
        auroc=float(metrics.roc_auc_score(labels, scores)),
        aupr_out=float(metrics.average_precision_score(labels, scores)),
        aupr_in=float(metrics.average_precision_score(1 - labels, -scores)),
        fpr95=fpr_at_tpr(inside, outside, 0.95),
    )


@dataclass(frozen=True)
class RiskCoverage:
    """The selective risk (mean error of the kept items) at each coverage ``k / n``, keeping the
    ``k`` least uncertain items, ``k = 1..n``."""

    coverage: np.ndarray
    risk: np.ndarray

    @property
    def aurc(self) -> float:
        """Area under the risk-coverage curve: the mean risk over the ``n`` coverages."""
        return float(self.risk.mean())

    def risk_at(self, coverage: float) -> float:
        """Selective risk when the ``ceil(coverage * n)`` least uncertain items are kept."""
        if not 0 < coverage <= 1:
            raise ValueError(f"coverage must lie in (0, 1], got {coverage}")
        kept = int(np.ceil(coverage * self.risk.size - 1e-9))
        return float(self.risk[kept - 1])

    def accuracy_at(self, coverage: float) -> float:
        """Accuracy of the kept items at ``coverage``: ``1 - risk_at(coverage)``."""
        return 1.0 - self.risk_at(coverage)


def risk_coverage(scores, correct) -> RiskCoverage:
    """The risk-coverage curve of abstaining on the most uncertain items first.

    ``scores``: uncertainty per item (higher abstains first); ``correct``: per item in [0, 1].
    """
    s = _scores(scores, "scores")
    c = _array(correct).reshape(-1)
    if c.shape != s.shape:
        raise ValueError(f"correct ({c.size} items) and scores ({s.size} items) must have the same length")
    if (c < 0).any() or (c > 1).any():
        raise ValueError("correct must lie in [0, 1]")
    order = np.argsort(s, kind="stable")
    s, errors = s[order], 1.0 - c[order]
    # ties: within a run of equal scores, every position holds the run's mean error
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    sizes = np.diff(np.r_[starts, s.size])
    run_mean = np.add.reduceat(errors, starts) / sizes
    expected = np.repeat(run_mean, sizes)
    kept = np.arange(1, s.size + 1)
    return RiskCoverage(coverage=kept / s.size, risk=np.cumsum(expected) / kept)


def fit_temperature(logits, labels, max_iter: int = 100) -> float:
    """The temperature ``T > 0`` whose ``softmax(logits / T)`` has the least negative log-likelihood
    of ``labels`` (held-out items: a validation split), by L-BFGS on ``log T`` from ``T = 1``."""
    z = torch.as_tensor(_array(logits))
    y = torch.as_tensor(np.asarray(labels)).long()
    if z.ndim != 2 or z.shape[1] < 2 or y.shape != z.shape[:1]:
        raise ValueError(f"expected logits [items, classes >= 2] and one label per item, got {tuple(z.shape)} and {tuple(y.shape)}")
    if not torch.isfinite(z).all():
        raise ValueError("logits must be finite")
    if (y < 0).any() or (y >= z.shape[1]).any():
        raise ValueError(f"labels must be integers in [0, {z.shape[1]})")
    log_t = torch.zeros((), dtype=z.dtype, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(z / log_t.exp(), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    return float(log_t.detach().exp())
