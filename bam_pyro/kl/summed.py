"""The KL of an attention map: the closed form summed over the map's valid entries.

An attention site's distribution is an :class:`~bam_pyro.attention_map.AttentionMap`, one event
over every entry of one attention call. Its KL, the only term ``TraceMeanField_ELBO`` reads at
these sites, is :func:`summed_kl` of its element-wise q and prior: for the two pairs of the paper
the sum over the valid entries computed directly (:func:`summed_kl_mean_weibull_gamma`,
:func:`summed_kl_lognormal_lognormal`), for any other pair the generic route
(:func:`entrywise_summed_kl`: the entry-wise KL, masked, then summed). Summing directly lets a
rule work at the compact shape of the prior (one value per key) and skip the full-size masked KL map.
"""

from __future__ import annotations

import math
from typing import Optional

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import Gamma, LogNormal, kl_divergence, register_kl

from ..attention_map import AttentionMap, event_sum
from ..distributions import MeanWeibull
from .closed_forms import compact, kl_lognormal_lognormal, weibull_gamma_constant

def aligned(t: Tensor, ndim: int) -> Tensor:
    """``t`` viewed with leading size-1 dims up to ``ndim`` dims (as broadcasting aligns it)."""
    return t.reshape((1,) * (ndim - t.dim()) + tuple(t.shape))


def valid_total(values: Tensor, mask: Optional[Tensor], shape: torch.Size, event_dim: int) -> Tensor:
    """Sum over the valid entries of each map of ``values`` broadcast to ``shape``, computed at the
    compact shape of ``values`` (e.g. one value per key): each value counts as many times as it
    has valid entries. Returns the batch shape ``shape[:-event_dim]``."""
    ndim = len(shape)
    events = range(ndim - event_dim, ndim)
    values = aligned(values, ndim)
    counted: list[int] = []  # event dims whose copies the mask counts
    if mask is not None:
        mask = aligned(mask, ndim)
        counted = [d for d in events if values.shape[d] == 1 and mask.shape[d] > 1]
        counts = mask.sum(dim=counted, keepdim=True, dtype=values.dtype) if counted else mask.to(values.dtype)
        values = values * counts
    copies = math.prod([shape[d] for d in events if values.shape[d] == 1 and d not in counted])  # a list: Dynamo traces it
    total = event_sum(values, event_dim) * copies
    return total.expand(shape[: ndim - event_dim])


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
            exp_phi = torch.exp(phi)
            # grad * (b e^Phi - a), into e^Phi's memory where it has the result's shape (no fresh map)
            into = exp_phi if exp_phi.shape == torch.broadcast_shapes(exp_phi.shape, a.shape, b.shape, grad.shape) else None
            grad_phi = torch.addcmul(torch.mul(a, grad).neg_(), b * grad, exp_phi, out=into)
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


def summed_kl_mean_weibull_gamma(q: MeanWeibull, p: Gamma, mask: Optional[Tensor], event_dim: int) -> Tensor:
    """:func:`kl_mean_weibull_gamma` summed over the valid entries of each map, without building
    the entry-wise KL: the terms of alpha and beta alone are summed at the prior's compact shape
    (counted once per valid entry), and the terms with Phi, ``beta*exp(Phi) - alpha*Phi``, by
    reductions whose backward keeps only Phi and compact sums."""
    alpha, beta = compact(p.concentration), compact(p.rate)
    k = alpha.new_tensor(q.k)
    constant = weibull_gamma_constant(k, alpha, beta, q.log_mean_factor)
    shape = q.batch_shape if q.batch_shape == p.batch_shape else torch.broadcast_shapes(q.batch_shape, p.batch_shape)
    entries = _ValidEntrySum.apply(q.log_mean, alpha, beta, mask, event_dim)
    return valid_total(constant, mask, shape, event_dim) + entries


def summed_kl_lognormal_lognormal(q: LogNormal, p: LogNormal, mask: Optional[Tensor], event_dim: int) -> Tensor:
    """:func:`kl_lognormal_lognormal` summed over the valid entries of each map, called directly:
    torch's ``kl_divergence`` dispatch, the generic route, is code ``torch.compile`` stops at."""
    kl = kl_lognormal_lognormal(q, p)
    return event_sum(kl if mask is None else kl.masked_fill(~mask, 0.0), event_dim)


def summed_kl(q: dist.TorchDistribution, p: dist.TorchDistribution, mask: Optional[Tensor], event_dim: int) -> Tensor:
    """KL(q || p) of element-wise distributions summed over the valid entries (``mask``, or all) of
    each map of ``event_dim`` dims. Raises NotImplementedError (Pyro's cue for a Monte Carlo
    estimate) for a pair torch has no KL of."""
    if isinstance(q, MeanWeibull) and isinstance(p, Gamma):
        return summed_kl_mean_weibull_gamma(q, p, mask, event_dim)
    if isinstance(q, LogNormal) and isinstance(p, LogNormal):
        return summed_kl_lognormal_lognormal(q, p, mask, event_dim)
    return entrywise_summed_kl(q, p, mask, event_dim)


def entrywise_summed_kl(q: dist.TorchDistribution, p: dist.TorchDistribution, mask: Optional[Tensor],
                        event_dim: int) -> Tensor:
    """The generic route: torch's entry-wise ``kl_divergence(q, p)``, masked, summed over each map."""
    kl = kl_divergence(q, p)
    if mask is not None:
        kl = kl.masked_fill(~mask, 0.0)
    return event_sum(kl, event_dim)


@register_kl(AttentionMap, AttentionMap)
def kl_attention_maps(q: AttentionMap, p: AttentionMap) -> Tensor:
    """The KL of two attention maps (q's mask; model and guide build the same one): where torch's
    ``kl_divergence``, which ``TraceMeanField_ELBO`` calls at every attention site, lands."""
    return summed_kl(q.base_dist, p.base_dist, q.mask, q.event_dim)
