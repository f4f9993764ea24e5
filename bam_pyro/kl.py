"""Closed-form KL divergences for the variational/prior pairs of Bayesian attention.

Registered on the torch classes (Pyro's distributions subclass them), so that
``TraceMeanField_ELBO`` finds them through ``torch.distributions.kl_divergence`` and never
falls back to a Monte Carlo estimate.

Both are written to stay finite in float32 at the paper's extreme hyperparameters
(k up to 1e3, beta down to 1e-15, alpha down to 1e-15 and below, sigma_p from 1e-15 to 1e15
against sigma_q from 1e-15 to :data:`~bam_pyro.config.MAX_SIGMA_Q`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.distributions import Gamma, LogNormal, Weibull, register_kl

from .attention_map import aligned, event_sum, register_summed_kl, valid_total
from .distributions import EULER_GAMMA, MeanWeibull


def _compact(t: Tensor) -> Tensor:
    """The distinct values of a broadcast (expanded) tensor: size 1 where its stride is 0.

    Priors and shapes are expanded over all attention entries, but vary only per key or not at
    all; terms that depend on them alone are computed at this compact shape and broadcast back
    in the sum, which saves several full-size operations and saved tensors per attention map.
    """
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None) for stride, size in zip(t.stride(), t.shape))
    return t[index]


def _weibull_gamma_constant(k: Tensor, alpha: Tensor, beta: Tensor, log_mean_factor: float = 0.0) -> Tensor:
    """The KL terms of k, alpha and beta only (compact shape),
    ``alpha * (gamma/k - log(beta) + log_mean_factor) + log(k) - gamma - 1 + lgamma(alpha)``;
    ``log_mean_factor`` is the ``lgamma(1 + 1/k)`` that q given by its log-mean adds per alpha.

    ``lgamma(alpha)`` is evaluated as ``lgamma(1 + alpha) - log(alpha)``, exact and free of the
    cancellation that plain ``lgamma`` suffers for alpha near 0. The factors of alpha are combined
    first: with a per-entry alpha (edges) that keeps the full-size work to five passes.
    """
    slope = EULER_GAMMA / k - torch.log(beta) + log_mean_factor
    log_gamma_alpha = torch.lgamma(1 + alpha) - torch.log(alpha)
    return torch.addcmul(log_gamma_alpha + (torch.log(k) - EULER_GAMMA - 1.0), alpha, slope)


@register_kl(Weibull, Gamma)
def kl_weibull_gamma(q: Weibull, p: Gamma) -> Tensor:
    """KL(Weibull(k, lam) || Gamma(alpha, beta)).

    = gamma*alpha/k - alpha*log(lam) + log(k) + beta*lam*Gamma(1 + 1/k) - gamma - 1
      - alpha*log(beta) + log Gamma(alpha)
    """
    k, lam = _compact(q.concentration), q.scale
    alpha, beta = _compact(p.concentration), _compact(p.rate)
    mean_factor = beta * torch.exp(torch.lgamma(1 + k.reciprocal()))
    kl = _weibull_gamma_constant(k, alpha, beta) - alpha * torch.log(lam) + mean_factor * lam
    return kl.expand(torch.broadcast_shapes(lam.shape, alpha.shape, k.shape, beta.shape))


class _MeanWeibullGammaEntries(torch.autograd.Function):
    """``beta * exp(Phi) - alpha * Phi`` whose backward keeps Phi and recomputes exp(Phi)."""

    @staticmethod
    def forward(ctx, log_mean: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
        ctx.save_for_backward(log_mean, alpha, beta)
        return beta * torch.exp(log_mean) - alpha * log_mean

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        log_mean, alpha, beta = ctx.saved_tensors
        grads: list[Optional[Tensor]] = [None, None, None]
        if ctx.needs_input_grad[0]:
            grads[0] = grad * (beta * torch.exp(log_mean) - alpha)
        if ctx.needs_input_grad[1]:
            grads[1] = (-grad * log_mean).sum_to_size(alpha.shape)
        if ctx.needs_input_grad[2]:
            grads[2] = (grad * torch.exp(log_mean)).sum_to_size(beta.shape)
        return tuple(grads)


@register_kl(MeanWeibull, Gamma)
def kl_mean_weibull_gamma(q: MeanWeibull, p: Gamma) -> Tensor:
    """The same KL for q given its log-mean Phi, where ``log lam = Phi - lgamma(1 + 1/k)`` and
    ``lam * Gamma(1 + 1/k) = exp(Phi)``: constant + alpha*lgamma(1 + 1/k) - alpha*Phi + beta*exp(Phi).

    The entry-wise part is recomputed in the backward pass instead of keeping exp(Phi), so the KL
    of an attention map costs no saved map beyond Phi itself.
    """
    alpha, beta = _compact(p.concentration), _compact(p.rate)
    k = alpha.new_tensor(q.k)
    constant = _weibull_gamma_constant(k, alpha, beta, q.log_mean_factor)
    entries = _MeanWeibullGammaEntries.apply(q.log_mean, alpha, beta)
    return (constant + entries).expand(torch.broadcast_shapes(q.batch_shape, alpha.shape, beta.shape))


class _ValidEntrySum(torch.autograd.Function):
    """Per map, the sum over valid entries of ``b * exp(Phi) - a * Phi`` (a, b broadcast to Phi,
    typically one value per key).

    Phi and exp(Phi) are first summed over the entries that share a weight (e.g. over the
    queries, for one weight per key), so the products are compact; those sums also give the
    gradients of a and b. Keeps Phi, the compact weights and sums; ``exp(Phi)`` is recomputed for
    the gradient of Phi."""

    @staticmethod
    def forward(ctx, phi: Tensor, a: Tensor, b: Tensor, mask: Optional[Tensor], event_dim: int) -> Tensor:
        ndim = max(phi.dim(), a.dim(), b.dim())
        a_, b_ = aligned(a, ndim), aligned(b, ndim)
        phi_sum = _valid_sum_per_weight(aligned(phi, ndim), a_, mask, event_dim)
        exp_sum = _valid_sum_per_weight(aligned(torch.exp(phi), ndim), b_, mask, event_dim)
        ctx.event_dim, ctx.ndim = event_dim, ndim
        ctx.save_for_backward(phi, a, b, mask, phi_sum, exp_sum)
        return event_sum(b_ * exp_sum, event_dim) - event_sum(a_ * phi_sum, event_dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        phi, a, b, mask, phi_sum, exp_sum = ctx.saved_tensors
        grad = aligned(grad.reshape(grad.shape + (1,) * ctx.event_dim), ctx.ndim)  # one value per map
        grads: list[Optional[Tensor]] = [None, None, None, None, None]
        if ctx.needs_input_grad[0]:
            grad_phi = torch.addcmul(-a * grad, b * grad, torch.exp(phi))  # grad * (b e^Phi - a)
            if mask is not None:
                grad_phi = grad_phi.masked_fill_(~mask, 0.0)
            grads[0] = grad_phi.sum_to_size(phi.shape)
        if ctx.needs_input_grad[1]:
            grads[1] = (-grad * phi_sum).sum_to_size(a.shape)
        if ctx.needs_input_grad[2]:
            grads[2] = (grad * exp_sum).sum_to_size(b.shape)
        return tuple(grads)


def _valid_sum_per_weight(values: Tensor, weight: Tensor, mask: Optional[Tensor], event_dim: int) -> Tensor:
    """``values`` with invalid entries zeroed, summed over the event dims where ``weight`` is
    constant (size 1), kept as size-1 dims."""
    if mask is not None:
        values = values.masked_fill(~mask, 0.0)
    ndim = values.dim()
    dims = [d for d in range(ndim - event_dim, ndim) if weight.shape[d] == 1 and values.shape[d] > 1]
    return values.sum(dim=dims, keepdim=True) if dims else values


@register_summed_kl(MeanWeibull, Gamma)
def summed_kl_mean_weibull_gamma(q: MeanWeibull, p: Gamma, mask: Optional[Tensor], event_dim: int) -> Tensor:
    """:func:`kl_mean_weibull_gamma` summed over the valid entries of each map, without building
    the entry-wise KL: the terms of alpha and beta alone are summed at the prior's compact shape
    (counted once per valid entry), and the terms with Phi, ``beta*exp(Phi) - alpha*Phi``, by
    reductions whose backward keeps only Phi and compact sums."""
    alpha, beta = _compact(p.concentration), _compact(p.rate)
    k = alpha.new_tensor(q.k)
    constant = _weibull_gamma_constant(k, alpha, beta, q.log_mean_factor)
    shape = q.batch_shape if q.batch_shape == p.batch_shape else torch.broadcast_shapes(q.batch_shape, p.batch_shape)
    entries = _ValidEntrySum.apply(q.log_mean, alpha, beta, mask, event_dim)
    return valid_total(constant, mask, shape, event_dim) + entries


@register_kl(LogNormal, LogNormal)
def kl_lognormal_lognormal(q: LogNormal, p: LogNormal) -> Tensor:
    """KL(LogNormal(m1, s1) || LogNormal(m2, s2)) = log(s2/s1) + (s1^2 + (m1-m2)^2)/(2 s2^2) - 1/2.

    Overrides torch's generic transformed-distribution rule, which squares ``s1/s2`` before taking
    its log and returns inf once that ratio underflows (s1=1e-15, s2=1e15).
    """
    ratio = q.scale / p.scale
    shift = (q.loc - p.loc) / p.scale
    return torch.log(p.scale) - torch.log(q.scale) + 0.5 * (ratio.square() + shift.square()) - 0.5


@register_summed_kl(LogNormal, LogNormal)
def summed_kl_lognormal_lognormal(q: LogNormal, p: LogNormal, mask: Optional[Tensor], event_dim: int) -> Tensor:
    """:func:`kl_lognormal_lognormal` summed over the valid entries of each map, called directly:
    torch's ``kl_divergence`` dispatch, the generic route, is code ``torch.compile`` stops at."""
    kl = kl_lognormal_lognormal(q, p)
    return event_sum(kl if mask is None else kl.masked_fill(~mask, 0.0), event_dim)


# Row-wise closed forms for the fused path (bam_pyro.fused_sites): the KL of one query's row of
# entries from row statistics, without the map. Row i has the valid keys V_i (n_i of them), scores
# s_ij and Phi_ij = s_ij - lse_i with lse_i = logsumexp over V_i. The fused path takes Phi exactly,
# without the materialized path's floor log(p + 1e-20), so the two differ only where an attention
# weight is below 1e-20 (by alpha * the log of the floor's share, per such entry).


def weibull_gamma_row_kl(lse: Tensor, alpha_sum: Tensor, alpha_score_sum: Tensor, constant_sum: Tensor,
                         beta: float, has_keys: Tensor) -> Tensor:
    """Sum over a row of KL(Weibull(k, exp(Phi) / Gamma(1 + 1/k)) || Gamma(alpha_ij, beta)).

    With the entry-wise KL ``c(alpha) - alpha * Phi + beta * exp(Phi)`` (:func:`kl_mean_weibull_gamma`,
    ``c`` the terms of alpha alone, with ``lgamma(1 + 1/k)``), a row needs

        sum_j c(alpha_ij)  -  sum_j alpha_ij s_ij  +  lse_i * sum_j alpha_ij  +  beta

    (``sum_j exp(Phi_ij) = 1``): ``constant_sum`` = sum_j c(alpha_ij), ``alpha_score_sum`` = sum_j
    alpha_ij s_ij (for dot-product scores ``q_i . sum_j alpha_ij k_j``), ``alpha_sum`` = sum_j
    alpha_ij. ``has_keys``: 1 for rows with a valid key, else 0 (their terms are all zero).

    float32: ``lse_i * sum alpha`` and ``sum alpha s`` are of the size of the scores times
    ``sum alpha`` and cancel down to the KL's alpha * Phi part; with alpha ~ beta * Psi that is
    no worse than the entry-wise form. The callers sum in float64.
    """
    return constant_sum - alpha_score_sum + lse * alpha_sum + beta * has_keys


def lognormal_row_kl(lse: Tensor, count: Tensor, score_sum: Tensor, square_sum: Tensor, score_mu_sum: Tensor,
                     mu_sum: Tensor, mu_square_sum: Tensor, sigma_q: float, sigma_p: float) -> Tensor:
    """Sum over a row of KL(LogNormal(Phi - sigma_q^2/2, sigma_q) || LogNormal(mu_ij, sigma_p)).

    Entry-wise (:func:`kl_lognormal_lognormal`): ``log(sigma_p/sigma_q) + sigma_q^2/(2 sigma_p^2) - 1/2
    + (s_ij - mu_ij - a_i)^2 / (2 sigma_p^2)`` with ``a_i = lse_i + sigma_q^2/2``; the square expands
    into the row sums ``score_sum`` = sum_j s_ij (``q_i . sum_j k_j``), ``square_sum`` = sum_j s_ij^2
    (``q_i^T (sum_j k_j k_j^T) q_i``), ``score_mu_sum`` = sum_j s_ij mu_ij, ``mu_sum``,
    ``mu_square_sum`` and ``count`` = n_i.

    float32: the expansion cancels terms of size n_i * a_i^2 down to the spread of Phi; the callers
    sum in float64, where at n_i = 10^5 and |a_i| ~ 30 the KL keeps about 8 digits.
    """
    shift = lse + 0.5 * sigma_q**2
    squares = (square_sum - 2 * score_mu_sum + mu_square_sum) - 2 * shift * (score_sum - mu_sum) + count * shift.square()
    constant = math.log(sigma_p) - math.log(sigma_q) + 0.5 * (sigma_q / sigma_p) ** 2 - 0.5
    return count * constant + squares * (0.5 / sigma_p**2)
