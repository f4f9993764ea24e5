"""OOD detection, selective prediction and adaptive calibration, against hand-computed cases and
against TorchMetrics and scikit-learn."""

import itertools

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, MulticlassCalibrationError

from bam_pyro.metrics import adaptive_calibration_error, expected_calibration_error, max_probability
from bam_pyro.shift import fit_temperature, fpr_at_tpr, ood_detection, risk_coverage


def test_a_score_that_cannot_separate_gives_auroc_one_half_and_a_perfect_one_gives_one():
    blind = ood_detection(np.full(50, 0.3), np.full(30, 0.3))
    assert blind.auroc == 0.5
    assert blind.fpr95 == 1.0  # flagging any OOD item flags every in-distribution item
    perfect = ood_detection(np.linspace(0, 1, 50), np.linspace(2, 3, 30))
    assert (perfect.auroc, perfect.fpr95) == (1.0, 0.0)
    assert perfect.aupr_out == pytest.approx(1.0) and perfect.aupr_in == pytest.approx(1.0)
    reversed_ = ood_detection(np.linspace(2, 3, 50), np.linspace(0, 1, 30))
    assert reversed_.auroc == 0.0


def test_detection_by_hand():
    # in: 0.1 0.4 0.35 0.8 ; out: 0.9 0.5 0.3 — pairs (out > in) counted: 0.9 beats 4, 0.5 beats 3,
    # 0.3 beats 1 (0.1): 8 of 12
    inside, outside = np.array([0.1, 0.4, 0.35, 0.8]), np.array([0.9, 0.5, 0.3])
    result = ood_detection(inside, outside)
    assert result.auroc == pytest.approx(8 / 12)
    # ranking by score: 0.9 (out), 0.8 (in), 0.5 (out), 0.4, 0.35, 0.3 (out), 0.1
    # AP with OOD positive: precision at each OOD hit: 1/1, 2/3, 3/6
    assert result.aupr_out == pytest.approx((1 + 2 / 3 + 3 / 6) / 3)
    # 95% of three OOD items needs all three: threshold 0.3 flags 3 of 4 in-distribution items
    assert result.fpr95 == pytest.approx(3 / 4)
    assert fpr_at_tpr(inside, outside, tpr=2 / 3) == pytest.approx(1 / 4)


@pytest.mark.parametrize("seed", range(5))
def test_detection_equals_torchmetrics(seed):
    rng = np.random.default_rng(seed)
    inside = rng.normal(0.0, 1.0, 300).round(1)  # rounded: ties between the sets
    outside = rng.normal(0.8, 1.2, 120).round(1)
    result = ood_detection(inside, outside)
    both = np.concatenate([inside, outside])
    # TorchMetrics reads scores outside [0, 1] as logits: rescale (ranks unchanged) into [0, 1]
    scores = torch.tensor((both - both.min()) / (both.max() - both.min()))
    labels = torch.cat([torch.zeros(inside.size), torch.ones(outside.size)]).long()
    assert result.auroc == pytest.approx(BinaryAUROC()(scores, labels).item(), abs=1e-6)
    assert result.aupr_out == pytest.approx(BinaryAveragePrecision()(scores, labels).item(), abs=1e-6)
    assert result.aupr_in == pytest.approx(BinaryAveragePrecision()(1 - scores, 1 - labels).item(), abs=1e-6)
    # FPR95 from its definition: the largest threshold flagging >= 95% of OOD items
    threshold = max(t for t in np.unique(both) if (outside >= t).mean() >= 0.95)
    assert result.fpr95 == pytest.approx((inside >= threshold).mean())


def test_risk_coverage_by_hand():
    scores = np.array([0.2, 0.9, 0.1, 0.5])
    correct = np.array([1, 0, 1, 0])
    curve = risk_coverage(scores, correct)
    # kept in order 0.1 (right), 0.2 (right), 0.5 (wrong), 0.9 (wrong)
    np.testing.assert_allclose(curve.coverage, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(curve.risk, [0, 0, 1 / 3, 1 / 2])
    assert curve.aurc == pytest.approx((0 + 0 + 1 / 3 + 1 / 2) / 4)
    assert curve.accuracy_at(0.5) == 1.0
    assert curve.accuracy_at(0.6) == pytest.approx(2 / 3)  # ceil(0.6 * 4) = 3 kept
    assert curve.risk_at(1.0) == 0.5


def test_risk_coverage_breaks_ties_by_expectation_and_ignores_input_order():
    scores = np.array([0.5, 0.5, 0.1, 0.5])
    correct = np.array([0.0, 1.0, 1.0, 1.0])
    curve = risk_coverage(scores, correct)
    # averaged over every order of the three tied items
    orders = [np.array(p) for p in itertools.permutations([0, 1, 3])]
    risks = [np.cumsum(1 - correct[np.r_[2, p]]) / np.arange(1, 5) for p in orders]
    np.testing.assert_allclose(curve.risk, np.mean(risks, 0))
    shuffled = risk_coverage(scores[::-1], correct[::-1])
    np.testing.assert_allclose(shuffled.risk, curve.risk)


def test_aurc_is_least_when_the_errors_are_the_most_uncertain():
    rng = np.random.default_rng(0)
    correct = rng.random(200) < 0.7
    oracle = risk_coverage(~correct + rng.random(200) * 0.1, correct).aurc
    blind = risk_coverage(np.zeros(200), correct).aurc
    anti = risk_coverage(correct.astype(float), correct).aurc
    assert oracle < blind < anti
    assert blind == pytest.approx(1 - correct.mean())  # constant score: the overall risk everywhere


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="in_scores must be finite"):
        ood_detection([0.1, np.nan], [0.2])
    with pytest.raises(ValueError, match="out_scores is empty"):
        ood_detection([0.1], [])
    with pytest.raises(ValueError, match="same length"):
        risk_coverage([0.1, 0.2], [1])
    with pytest.raises(ValueError, match="coverage must lie in"):
        risk_coverage([0.1], [1]).risk_at(0)


def test_adaptive_calibration_error_by_hand_and_equal_to_ece_with_one_bin():
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]])
    labels = np.array([0, 1, 1, 0])
    # two equal-mass bins by confidence: {0.6 (wrong), 0.7 (right)} and {0.8 (wrong), 0.9 (right)}
    expected = (abs(0.5 - 0.65) * 2 + abs(0.5 - 0.85) * 2) / 4
    assert adaptive_calibration_error(probs, labels, bins=2) == pytest.approx(expected)
    assert adaptive_calibration_error(probs, labels, bins=1) == pytest.approx(expected_calibration_error(probs, labels, bins=1))
    np.testing.assert_allclose(max_probability(probs), [0.9, 0.8, 0.7, 0.6])


def test_ece_equals_torchmetrics():
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(4) * 0.7, 500)
    labels = rng.integers(0, 4, 500)
    ours = expected_calibration_error(probs, labels, bins=10)
    theirs = MulticlassCalibrationError(num_classes=4, n_bins=10, norm="l1")(torch.tensor(probs), torch.tensor(labels))
    assert ours == pytest.approx(theirs.item(), abs=1e-6)


@pytest.mark.parametrize("temperature", [0.5, 2.5])
def test_temperature_fit_recovers_a_known_temperature(temperature):
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(20000, 5, generator=generator)
    labels = torch.distributions.Categorical(logits=logits / temperature).sample().numpy()
    assert fit_temperature(logits.numpy(), labels) == pytest.approx(temperature, rel=0.05)
    assert fit_temperature(logits.numpy() / temperature, labels) == pytest.approx(1.0, rel=0.05)
    with pytest.raises(ValueError, match="labels must be integers"):
        fit_temperature(logits.numpy(), labels + 5)
