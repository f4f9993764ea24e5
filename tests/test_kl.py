"""Closed-form KL divergences against Monte Carlo in float64, and their float32 behaviour at the
paper's extreme hyperparameters."""

import math

import pytest
import torch
from torch.distributions import Gamma, LogNormal, Weibull, kl_divergence

from bam_pyro import BamConfig
from bam_pyro.distributions import MIN_GAMMA_SHAPE, MeanWeibull, prior_distribution, variational_distribution
from bam_pyro.kl import kl_lognormal_lognormal, kl_mean_weibull_gamma, kl_weibull_gamma


def monte_carlo_kl(q, p, n=400_000):
    s = q.sample((n,))
    log_ratio = q.log_prob(s) - p.log_prob(s)
    return log_ratio.mean(0), log_ratio.std(0) / math.sqrt(n)


WEIBULL_GAMMA_CASES = [
    # (k, lam, alpha, beta)
    (1.0, 0.3, 0.3, 1.0),
    (2.5, 1.7, 2.0, 0.5),
    (10.0, 0.05, 1e-4, 1e-8),  # PubMed WF
    (1.0, 0.2, 1e-15, 1e-10),  # Cora WF
    (100.0, 0.01, 1e-7, 1e-15),  # CiteSeer WF
    (1000.0, 0.5, 1e-3, 1e-2),  # SST-2 / VQA scale
]


@pytest.mark.parametrize("k, lam, alpha, beta", WEIBULL_GAMMA_CASES)
def test_weibull_gamma_matches_monte_carlo(k, lam, alpha, beta):
    d = torch.float64
    q = Weibull(torch.tensor(lam, dtype=d), torch.tensor(k, dtype=d))
    p = Gamma(torch.tensor(alpha, dtype=d), torch.tensor(beta, dtype=d))
    exact = kl_weibull_gamma(q, p)
    estimate, stderr = monte_carlo_kl(q, p)
    assert abs(exact - estimate) < 5 * stderr + 1e-9 * abs(exact), (exact, estimate, stderr)


@pytest.mark.parametrize("k, lam, alpha, beta", WEIBULL_GAMMA_CASES)
def test_mean_weibull_is_the_same_law_with_the_same_kl(k, lam, alpha, beta):
    """q as the attention layers build it (from its log-mean) against torch's Weibull: the same
    density, mean, entropy and KL; its log-space samples pass the Monte Carlo KL check too."""
    d = torch.float64
    reference = Weibull(torch.tensor(lam, dtype=d), torch.tensor(k, dtype=d))
    q = MeanWeibull(reference.mean.log(), k)
    p = Gamma(torch.tensor(alpha, dtype=d), torch.tensor(beta, dtype=d))
    s = reference.sample((1000,))
    assert torch.allclose(q.log_prob(s), reference.log_prob(s), rtol=1e-9)
    assert torch.allclose(q.scale, reference.scale, rtol=1e-12)
    assert q.entropy().item() == pytest.approx(reference.entropy().item(), rel=1e-9, abs=1e-12)
    assert kl_divergence(q, p).item() == pytest.approx(kl_weibull_gamma(reference, p).item(), rel=1e-9)
    estimate, stderr = monte_carlo_kl(q, p)
    exact = kl_mean_weibull_gamma(q, p)
    assert abs(exact - estimate) < 5 * stderr + 1e-9 * abs(exact), (exact, estimate, stderr)


def test_mean_weibull_kl_gradients_equal_the_plain_formula():
    """The KL's recomputing backward gives the gradients of the textbook expression."""
    phi = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    log_alpha = torch.randn(1, 5, dtype=torch.float64, requires_grad=True)
    beta, k = torch.tensor(0.3, dtype=torch.float64), 2.5

    def prior():
        return Gamma(log_alpha.exp().expand(6, 5), beta.expand(6, 5))

    lean = torch.autograd.grad(kl_divergence(MeanWeibull(phi, k), prior()).pow(2).sum(), (phi, log_alpha))
    plain_q = Weibull(torch.exp(phi - math.lgamma(1 + 1 / k)), torch.tensor(k, dtype=torch.float64))
    plain = torch.autograd.grad(kl_weibull_gamma(plain_q, prior()).pow(2).sum(), (phi, log_alpha))
    for a, b in zip(lean, plain):
        assert torch.allclose(a, b, rtol=1e-10)


def test_weibull_gamma_formula_term_by_term():
    """An independent transcription of the paper's formula, in float64."""
    k, lam, alpha, beta = 3.0, 0.7, 0.4, 2.0
    g = 0.5772156649015329
    expected = (g * alpha / k - alpha * math.log(lam) + math.log(k) + beta * lam * math.gamma(1 + 1 / k)
                - g - 1 - alpha * math.log(beta) + math.lgamma(alpha))
    q = Weibull(torch.tensor(lam, dtype=torch.float64), torch.tensor(k, dtype=torch.float64))
    p = Gamma(torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64))
    assert kl_divergence(q, p).item() == pytest.approx(expected, rel=1e-12)


LOGNORMAL_CASES = [(0.3, 0.5, -0.2, 1.5), (-2.0, 0.1, 0.0, 0.3), (1.0, 2.0, 1.0, 2.0)]


@pytest.mark.parametrize("m1, s1, m2, s2", LOGNORMAL_CASES)
def test_lognormal_matches_monte_carlo(m1, s1, m2, s2):
    d = torch.float64
    q = LogNormal(torch.tensor(m1, dtype=d), torch.tensor(s1, dtype=d))
    p = LogNormal(torch.tensor(m2, dtype=d), torch.tensor(s2, dtype=d))
    exact = kl_divergence(q, p)
    estimate, stderr = monte_carlo_kl(q, p)
    assert abs(exact - estimate) < 5 * stderr + 1e-12, (exact, estimate, stderr)


def test_registered_kls_are_ours():
    q, p = Weibull(torch.tensor(1.0), torch.tensor(1.0)), Gamma(torch.tensor(1.0), torch.tensor(1.0))
    assert torch.distributions.kl._dispatch_kl(type(q), type(p)) is kl_weibull_gamma
    assert torch.distributions.kl._dispatch_kl(MeanWeibull, type(p)) is kl_mean_weibull_gamma
    ql = LogNormal(torch.tensor(0.0), torch.tensor(1.0))
    assert torch.distributions.kl._dispatch_kl(type(ql), type(ql)) is kl_lognormal_lognormal


def test_lognormal_extreme_scales_are_finite_in_float32():
    """sigma_q = 1e-15 against sigma_p = 1e15 (the paper's Cora LC): torch's generic rule gives inf."""
    q = LogNormal(torch.tensor([-3.0, -40.0]), torch.tensor(1e-15))
    p = LogNormal(torch.tensor([-2.0, 0.0]), torch.tensor(1e15))
    kl = kl_divergence(q, p)
    expected = math.log(1e15) - math.log(1e-15) - 0.5  # the other terms are below float32 resolution
    assert torch.isfinite(kl).all()
    assert kl.tolist() == pytest.approx([expected, expected], rel=1e-6)


@pytest.mark.parametrize("k, beta, alpha", [(1.0, 1e-10, 1e-15), (100.0, 1e-15, 1e-7), (1000.0, 1e-15, 1e-30), (1.0, 1.0, 1e-30)])
def test_weibull_gamma_float32_extremes_finite_with_finite_gradients(k, beta, alpha):
    phi = torch.linspace(-46.0, 0.0, 50, requires_grad=True)
    log_alpha = torch.full((50,), math.log(alpha), requires_grad=True)
    q = MeanWeibull(phi, k)  # as the attention layers build q
    p = Gamma(log_alpha.exp(), torch.tensor(beta))
    kl = kl_divergence(q, p)
    assert torch.isfinite(kl).all()
    (kl.sum() * 1e3).backward()  # a large upstream weight must not overflow either
    assert torch.isfinite(phi.grad).all() and torch.isfinite(log_alpha.grad).all()
    # for tiny alpha, dKL/dlog(alpha) = alpha * digamma(alpha) + ... -> -1 per entry
    if alpha < 1e-10:
        assert log_alpha.grad.sub(-1e3).abs().max() < 1.0


def test_fixed_gamma_shape_below_float32_range_is_floored_like_the_contextual_one():
    """alpha = 1e-46 is 0 in float32 (KL inf); the fixed prior floors it at MIN_GAMMA_SHAPE."""
    phi = torch.randn(2, 3, 4).log_softmax(-1)
    kls = []
    for alpha in (1e-46, MIN_GAMMA_SHAPE):
        config = BamConfig("wf", k=1.0, beta=1e-10, alpha=alpha)
        prior = prior_distribution(None, config, phi.shape, phi)
        kls.append(kl_divergence(variational_distribution(phi, config), prior))
    assert torch.isfinite(kls[0]).all() and torch.equal(kls[0], kls[1])


def _map_case(kind):
    """(phi, log_psi, mask, event_dim) of one attention site, float64, as the layers build them."""
    d = torch.float64
    if kind == "edges":  # one value per edge: nothing to compact
        phi = torch.randn(30, 4, dtype=d).log_softmax(0)
        return phi, torch.randn(30, 4, dtype=d).log_softmax(0), None, 2
    phi = torch.randn(6, 2, 3, 4, 5, dtype=d).log_softmax(-1)  # [draws, B, H, Lq, Lk]
    log_psi = torch.randn(6, 2, 3, 1, 5, dtype=d).log_softmax(-1)  # one value per key
    keys = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    mask = {
        "no mask": None,
        "key padding": keys[:, None, None, :],
        "query and key padding": (keys[:, :4, None] & keys[:, None, :])[:, None],
    }[kind]
    return phi, log_psi, mask, 4


@pytest.mark.parametrize("kind", ["no mask", "key padding", "query and key padding", "edges"])
def test_summed_site_kl_equals_the_masked_sum_of_entry_kls(kind):
    """The site KL, summed at the prior's compact shape, against the entry-wise closed form
    masked and summed: values and gradients (Phi, and the prior through log Psi)."""
    from bam_pyro.attention_map import AttentionMap

    phi, log_psi, mask, event_dim = _map_case(kind)
    phi.requires_grad_(), log_psi.requires_grad_()
    k, beta = 3.0, 0.2
    q = MeanWeibull(phi, k)
    alpha = torch.exp(log_psi + math.log(beta)).expand(phi.shape)
    p = Gamma(alpha, torch.tensor(beta, dtype=phi.dtype).expand(phi.shape))
    summed = kl_divergence(AttentionMap(q, mask, event_dim), AttentionMap(p, mask, event_dim))
    entries = kl_divergence(q, p)
    if mask is not None:
        entries = entries * mask
    reference = entries.sum(dim=tuple(range(-event_dim, 0)))
    assert summed.shape == reference.shape == phi.shape[: phi.dim() - event_dim]
    assert torch.allclose(summed, reference, rtol=1e-12)
    upstream = torch.rand_like(reference)
    got = torch.autograd.grad(summed, (phi, log_psi), upstream, retain_graph=True)
    expected = torch.autograd.grad(reference, (phi, log_psi), upstream)
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gamma_shape", ["psi_beta", "psi"])
def test_contextual_gamma_shape_and_its_pull_on_the_attention(gamma_shape):
    """alpha = Psi * beta (reference code) or Psi (paper's text). The KL's gradient in Phi is
    ``beta * exp(Phi) - alpha``: with beta = 1e-10 the first reading leaves q alone, the second
    pulls the attention towards Psi (a cross-entropy from Psi to W = exp(Phi))."""
    beta = 1e-10
    config = BamConfig("wc", k=1.0, beta=beta, gamma_shape=gamma_shape)
    psi = torch.tensor([0.7, 0.2, 0.1])
    phi = torch.log(torch.tensor([0.2, 0.3, 0.5])).requires_grad_()
    prior = prior_distribution(psi.log(), config, phi.shape, phi)
    expected_alpha = psi * beta if gamma_shape == "psi_beta" else psi
    assert torch.allclose(prior.concentration, expected_alpha)
    kl_divergence(variational_distribution(phi, config), prior).sum().backward()
    assert torch.allclose(phi.grad, beta * phi.detach().exp() - expected_alpha, atol=1e-7)
    if gamma_shape == "psi":  # descending the KL raises log W where Psi is large
        assert torch.allclose(phi.grad, -psi, atol=1e-6)

