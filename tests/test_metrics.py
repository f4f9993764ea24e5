"""Known-answer tests of the uncertainty metrics."""

import math
import warnings

import numpy as np
import pytest
import torch

from bam_pyro import metrics as M


def test_accuracy_nll_brier_by_hand():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.25, 0.25]])
    labels = np.array([0, 1, 0])
    assert M.accuracy(probs, labels) == pytest.approx(2 / 3)
    assert M.nll(probs, labels) == pytest.approx(-(math.log(0.7) + math.log(0.3) + math.log(0.5)) / 3)
    brier = ((0.3**2 + 0.2**2 + 0.1**2) + (0.1**2 + 0.7**2 + 0.6**2) + (0.5**2 + 0.25**2 + 0.25**2)) / 3
    assert M.brier(probs, labels) == pytest.approx(brier)


def test_metrics_accept_torch():
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8]])
    assert M.accuracy(probs, torch.tensor([0, 0])) == 0.5


def test_ece_zero_for_perfectly_calibrated_set():
    # 10 items at confidence 0.8 (8 right) and 10 at confidence 0.6 (6 right): calibrated per bin
    probs = np.array([[0.8, 0.2]] * 10 + [[0.6, 0.4]] * 10)
    labels = np.array([0] * 8 + [1] * 2 + [0] * 6 + [1] * 4)
    assert M.expected_calibration_error(probs, labels, bins=10) == pytest.approx(0.0, abs=1e-12)


def test_ece_by_hand_and_bins():
    # bin (0.9, 1.0]: conf 0.95, acc 0.5 (2 items); bin (0.5, 0.6]: conf 0.55, acc 1 (2 items)
    probs = np.array([[0.95, 0.05], [0.95, 0.05], [0.55, 0.45], [0.45, 0.55]])
    labels = np.array([0, 1, 0, 1])
    r = M.reliability(probs, labels, bins=10)
    assert r.counts.tolist() == [0, 0, 0, 0, 0, 2, 0, 0, 0, 2]
    assert r.ece == pytest.approx(0.5 * 0.45 + 0.5 * 0.45)
    assert np.isnan(r.accuracy[0])
    # a confidence exactly on an edge belongs to the lower bin: (0.5, 0.6] holds 0.6
    assert M.reliability(np.array([[0.6, 0.4]]), np.array([0]), bins=10).counts[5] == 1


def test_ece_weights_bins_by_their_counts():
    # bin (0.9, 1.0]: 3 items, conf 0.95, acc 2/3; bin (0.5, 0.6]: 1 item, conf 0.55, acc 1
    probs = np.array([[0.95, 0.05]] * 3 + [[0.55, 0.45]])
    labels = np.array([0, 0, 1, 0])
    assert M.expected_calibration_error(probs, labels, bins=10) == pytest.approx((3 * (0.95 - 2 / 3) + 0.45) / 4)


def test_entropy_and_mutual_information_of_known_distributions():
    uniform = np.full((1, 4), 0.25)
    assert M.entropy(uniform)[0] == pytest.approx(math.log(4))
    # two confident, disagreeing draws: H[mean] = log 2, mean H = 0, MI = log 2
    disagree = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    assert M.predictive_entropy(disagree)[0] == pytest.approx(math.log(2))
    assert M.mutual_information(disagree)[0] == pytest.approx(math.log(2))
    # identical draws: no epistemic uncertainty
    same = np.array([[[0.5, 0.5]], [[0.5, 0.5]]])
    assert M.mutual_information(same)[0] == pytest.approx(0.0)
    assert M.predictive_entropy(same)[0] == pytest.approx(math.log(2))


def test_top_two_pvalues_match_student_t_test():
    from scipy import stats

    rng = np.random.default_rng(0)
    a = rng.uniform(0.4, 0.6, size=10)
    b = (1 - a) * rng.uniform(0.8, 1.0, size=10)
    samples = np.stack([b, a, 1 - a - b], -1)[:, None, :]  # top class (by mean) is index 1
    expected = stats.ttest_ind(a, b, equal_var=True).pvalue
    assert 0.01 < expected < 0.05  # a moderate p-value, so a relative tolerance tells tests apart
    assert M.top_two_pvalues(samples)[0] == pytest.approx(expected, rel=1e-9)  # Welch's: 1.001 times it


def test_top_two_pvalues_of_constant_draws_are_exact():
    certain = np.tile([[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]], (5, 1, 1))
    assert M.top_two_pvalues(certain).tolist() == [0.0, 1.0]
    # float32-level noise counts as constant: exact answer, no precision-loss warning
    jitter = np.random.default_rng(0).uniform(-1e-8, 1e-8, size=(5, 2, 1)) * np.array([1.0, -1.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert M.top_two_pvalues(certain + jitter).tolist() == [0.0, 1.0]
        # top class exactly constant, the other two varying: a valid test, no warning
        second = np.array([0.2, 0.25, 0.3, 0.15, 0.2])
        mixed = np.stack([np.full(5, 0.6), second, 0.4 - second], -1)[:, None]
        assert 0 < M.top_two_pvalues(mixed)[0] < 1e-6


def test_pavpu_counts_by_hand_with_fractional_accuracy():
    acc = np.array([1.0, 1 / 3, 0.0, 1.0])
    certain = np.array([True, False, True, False])
    c = M.pavpu_counts(acc, certain)
    assert (c.accurate_certain, c.inaccurate_certain) == pytest.approx((1.0, 1.0))
    assert c.accurate_uncertain == pytest.approx(1 / 3 + 1)
    assert c.inaccurate_uncertain == pytest.approx(2 / 3)
    assert c.value == pytest.approx((1 + 2 / 3) / 4)


def test_pavpu_thresholds_from_samples():
    rng = np.random.default_rng(1)
    noisy = rng.uniform(0.45, 0.55, size=(50, 1))
    clear = np.full((50, 1), 0.9) + rng.normal(0, 0.01, size=(50, 1))
    samples = np.concatenate(
        [np.stack([noisy, 1 - noisy], -1), np.stack([clear, 1 - clear], -1)], axis=1
    )  # item 0 uncertain, item 1 certain
    assert M.pavpu(samples, [0.0, 1.0], threshold=0.05) == 1.0  # wrong+uncertain, right+certain
    assert M.pavpu(samples, [1.0, 0.0], threshold=0.05) == 0.0


def test_sample_metrics_row():
    samples = np.tile([[0.9, 0.1], [0.2, 0.8]], (4, 1, 1))
    row = M.sample_metrics(samples, np.array([0, 0]))
    assert row["accuracy"] == 0.5 and row["mutual_info"] == pytest.approx(0.0)
    assert row["pavpu@0.05"] == 0.5  # both certain, one right


def test_sample_metrics_known_answers():
    # item 0: constant draws (certain), right; item 1: draws alternating, mean (0.55, 0.45), so
    # predicted 0 but labelled 1 (wrong), top-two t-test p = 0.32 (uncertain)
    draws = [[[0.52, 0.48], [0.7, 0.3]], [[0.52, 0.48], [0.4, 0.6]]] * 3
    row = M.sample_metrics(np.array(draws), np.array([0, 1]), bins=10)
    assert row["accuracy"] == 0.5
    assert all(row[f"pavpu@{t:g}"] == 1.0 for t in M.PAVPU_THRESHOLDS)  # right and certain, wrong and uncertain
    assert row["nll"] == pytest.approx(-(math.log(0.52) + math.log(0.45)) / 2)  # of the mean, not the draws' mean
    assert row["brier"] == pytest.approx((2 * 0.48**2 + 2 * 0.55**2) / 2)
    # 10 bins: both in (0.5, 0.6], conf 0.535, acc 0.5 (15 bins would part them: 0.515)
    assert row["ece"] == pytest.approx(0.035)


@pytest.mark.parametrize(
    "probs, match",
    [
        (np.array([[0.5, 0.6]]), "sum to one"),
        (np.array([[1.2, -0.2]]), r"\[0, 1\]"),
        (np.array([[np.nan, 1.0]]), "finite"),
        (np.array([1.0]), "class axis"),
    ],
)
def test_bad_probabilities_are_refused(probs, match):
    with pytest.raises(ValueError, match=match):
        M.accuracy(probs, np.zeros(probs.shape[:-1], dtype=int))


def test_bad_labels_and_shapes_are_refused():
    probs = np.array([[0.5, 0.5]])
    with pytest.raises(ValueError, match="do not match"):
        M.nll(probs, np.array([0, 1]))
    with pytest.raises(ValueError, match="integers"):
        M.nll(probs, np.array([2]))
    with pytest.raises(ValueError, match="draws, items, classes"):
        M.mutual_information(probs)
    with pytest.raises(ValueError, match="at least 2 draws"):
        M.top_two_pvalues(probs[None])
