"""One attention map as one Pyro event: the distribution of an attention site.

An attention site's value S covers every entry of one attention call (``[B, H, Lq, Lk]`` dense,
``[E, H]`` over edges). :class:`AttentionMap` wraps the element-wise q or prior of those entries,
declares them one event and leaves out the invalid (padded) entries: the role Pyro's
``.mask(mask).to_event(n)`` plays, with one difference that matters for speed. Its KL, the only
term ``TraceMeanField_ELBO`` reads at these sites, is the sum over the valid entries computed
directly (:func:`bam_pyro.kl.summed.summed_kl`) rather than the masked entry-wise KL summed.
"""

from __future__ import annotations

from typing import Optional

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import constraints


def event_sum(values: Tensor, event_dim: int) -> Tensor:
    """Sum over the rightmost ``event_dim`` dims."""
    return values.sum(dim=tuple(range(-event_dim, 0))) if event_dim else values


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
