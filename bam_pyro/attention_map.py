"""One attention map as one Pyro event: the distribution of an attention site.

An attention site's value S covers every entry of one attention call (``[B, H, Lq, Lk]`` dense,
``[E, H]`` over edges). :class:`AttentionMap` wraps the element-wise q or prior of those entries,
declares them one event and leaves out the invalid (padded) entries: the role Pyro's
``.mask(mask).to_event(n)`` plays, with one difference that matters for speed. Its KL, the only
term ``TraceMeanField_ELBO`` reads at these sites, is computed as the sum over the valid entries
directly, by a rule registered per element-wise pair with :func:`register_summed_kl`; the generic
route (the entry-wise KL, masked, then summed) is the fallback. Summing directly lets a rule
work at the compact shape of the prior (one value per key) and skip the full-size masked KL map.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import constraints, kl_divergence, register_kl

#: f(q, p, mask, event_dim) -> the KL summed over the valid entries of each map
SummedKL = Callable[[dist.TorchDistribution, dist.TorchDistribution, Optional[Tensor], int], Tensor]
_SUMMED_KL: dict[tuple[type, type], SummedKL] = {}


def register_summed_kl(q_type: type, p_type: type) -> Callable[[SummedKL], SummedKL]:
    """Decorator: ``fn(q, p, mask, event_dim)`` is the summed KL of AttentionMaps of these bases."""

    def register(fn: SummedKL) -> SummedKL:
        _SUMMED_KL[q_type, p_type] = fn
        return fn

    return register


def event_sum(values: Tensor, event_dim: int) -> Tensor:
    """Sum over the rightmost ``event_dim`` dims."""
    return values.sum(dim=tuple(range(-event_dim, 0))) if event_dim else values


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


class AttentionMap(dist.TorchDistribution):
    """The entries of one attention call as one event, invalid entries masked out.

    ``base_dist``: element-wise distribution over the entries (its batch shape ends with the map);
    ``mask``: boolean, broadcastable to the entries (True = valid), or None; ``event_dim``: how many
    trailing dims make up the map. log-densities and KLs of masked entries are zero.
    """

    arg_constraints: dict = {}

    def __init__(self, base_dist: dist.TorchDistribution, mask: Optional[Tensor], event_dim: int) -> None:
        shape = base_dist.batch_shape
        if len(shape) < event_dim:
            raise ValueError(f"an attention map of {event_dim} dims needs entries of at least that rank, got {tuple(shape)}")
        split = len(shape) - event_dim
        self.base_dist, self.mask = base_dist, mask
        super().__init__(shape[:split], shape[split:], validate_args=False)

    @property
    def has_rsample(self) -> bool:
        return self.base_dist.has_rsample

    @constraints.dependent_property
    def support(self):
        return constraints.independent(self.base_dist.support, self.event_dim)

    @property
    def mean(self) -> Tensor:
        return self.base_dist.mean

    @property
    def variance(self) -> Tensor:
        return self.base_dist.variance

    def expand(self, batch_shape: torch.Size, _instance=None) -> "AttentionMap":
        base = self.base_dist.expand(torch.Size(batch_shape) + self.event_shape)
        return AttentionMap(base, self.mask, self.event_dim)

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:
        return self.base_dist.rsample(sample_shape)

    def sample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:
        return self.base_dist.sample(sample_shape)

    def log_prob(self, value: Tensor) -> Tensor:
        log_p = self.base_dist.log_prob(value)
        if self.mask is not None:
            log_p = log_p.masked_fill(~self.mask, 0.0)
        return event_sum(log_p, self.event_dim)


def _summed_kl_rule(q_type: type, p_type: type) -> Optional[SummedKL]:
    """The rule registered for these types or their nearest bases (Pyro's wrappers of torch's
    distributions subclass them)."""
    for q_base in q_type.__mro__:
        for p_base in p_type.__mro__:
            if (q_base, p_base) in _SUMMED_KL:
                return _SUMMED_KL[q_base, p_base]
    return None


@register_kl(AttentionMap, AttentionMap)
def _kl_attention_maps(q: AttentionMap, p: AttentionMap) -> Tensor:
    """The KL summed over the valid entries (q's mask; model and guide build the same one).
    Raises NotImplementedError (Pyro's cue for a Monte Carlo estimate) for unknown pairs."""
    summed = _summed_kl_rule(type(q.base_dist), type(p.base_dist))
    if summed is not None:
        return summed(q.base_dist, p.base_dist, q.mask, q.event_dim)
    kl = kl_divergence(q.base_dist, p.base_dist)
    if q.mask is not None:
        kl = kl.masked_fill(~q.mask, 0.0)
    return event_sum(kl, q.event_dim)
