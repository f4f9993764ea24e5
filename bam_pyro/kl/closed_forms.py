"""Closed-form KL divergences of the variational/prior pairs of Bayesian attention, entry by entry.

Registered on the torch classes (Pyro's distributions subclass them), so that
``TraceMeanField_ELBO`` finds them through ``torch.distributions.kl_divergence`` and never
falls back to a Monte Carlo estimate.

Both are written to stay finite in float32 at the paper's extreme hyperparameters
(k up to 1e3, beta down to 1e-15, alpha down to 1e-15 and below, sigma_p from 1e-15 to 1e15
against sigma_q from 1e-15 to :data:`~bam_pyro.config.MAX_SIGMA_Q`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.distributions import Gamma, LogNormal, Weibull, register_kl

from ..distributions import EULER_GAMMA, MeanWeibull


def compact(t: Tensor) -> Tensor:
    """The distinct values of a broadcast (expanded) tensor: size 1 where its stride is 0.

    Priors and shapes are expanded over all attention entries, but vary only per key or not at
    all; terms that depend on them alone are computed at this compact shape and broadcast back
    in the sum, which saves several full-size operations and saved tensors per attention map.
    """
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None) for stride, size in zip(t.stride(), t.shape))
    return t[index]


def weibull_gamma_constant(k: Tensor, alpha: Tensor, beta: Tensor, log_mean_factor: float = 0.0) -> Tensor:
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
    k, lam = compact(q.concentration), q.scale
    alpha, beta = compact(p.concentration), compact(p.rate)
    mean_factor = beta * torch.exp(torch.lgamma(1 + k.reciprocal()))
    kl = weibull_gamma_constant(k, alpha, beta) - alpha * torch.log(lam) + mean_factor * lam
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
    alpha, beta = compact(p.concentration), compact(p.rate)
    k = alpha.new_tensor(q.k)
    constant = weibull_gamma_constant(k, alpha, beta, q.log_mean_factor)
    entries = _MeanWeibullGammaEntries.apply(q.log_mean, alpha, beta)
    return (constant + entries).expand(torch.broadcast_shapes(q.batch_shape, alpha.shape, beta.shape))


@register_kl(LogNormal, LogNormal)
def kl_lognormal_lognormal(q: LogNormal, p: LogNormal) -> Tensor:
    """KL(LogNormal(m1, s1) || LogNormal(m2, s2)) = log(s2/s1) + (s1^2 + (m1-m2)^2)/(2 s2^2) - 1/2.

    Overrides torch's generic transformed-distribution rule, which squares ``s1/s2`` before taking
    its log and returns inf once that ratio underflows (s1=1e-15, s2=1e15).
    """
    ratio = q.scale / p.scale
    shift = (q.loc - p.loc) / p.scale
    return torch.log(p.scale) - torch.log(q.scale) + 0.5 * (ratio.square() + shift.square()) - 0.5
