"""Pyro plumbing: how an attention layer becomes a ``pyro.sample`` site.

Inside :func:`attention_sites` (entered by a Pyro model around its network), every stochastic
attention layer with a prior declares one sample site per call,

    S_l ~ p(S_l | keys_l)          (the prior, in the model)

and attaches its scores Phi_l to the site, from which the amortized guide
(:class:`~bam_pyro.guide.AttentionGuide`, a ``GuideMessenger``) builds q(S_l | Phi_l). Model and guide
therefore share one forward pass of the network; without a guide the site samples the prior.

The site's KL weight (annealing times reduction) is applied with ``poutine.scale``, and
``TraceMeanField_ELBO`` scales the analytic KL by it. Both prior and q are wrapped in
an :class:`~bam_pyro.attention_map.AttentionMap`: one event per attention call, padding masked
out (the KL of padded entries is exactly zero), the KL summed over the valid entries directly.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import pyro
import pyro.distributions as dist
from pyro import poutine
from torch import Tensor

from .attention_map import AttentionMap
from .axes import AttentionAxis
from .config import BamConfig
from .distributions import variational_distribution

#: key of the site's ``infer`` dict that carries what the guide needs
SITE_INFO = "bam_attention"


@dataclass(frozen=True)
class AttentionSiteInfo:
    """What an attention site hands to the guide: the scores Phi and how to read them."""

    phi: Tensor
    config: BamConfig
    mask: Optional[Tensor]
    event_dim: int

    def as_site_distribution(self, fn: dist.TorchDistribution) -> AttentionMap:
        """The site's distribution from an element-wise one: one event, invalid entries masked."""
        return AttentionMap(fn, self.mask, self.event_dim)

    def posterior(self) -> AttentionMap:
        """q(S | Phi), the guide's distribution at the site."""
        return self.as_site_distribution(variational_distribution(self.phi, self.config))

    def num_valid(self, axis: AttentionAxis) -> int:
        """Valid entries of one map (the KL's count under the ``mean`` reduction)."""
        return axis.num_valid(self.phi)


@dataclass
class AttentionSites:
    """State of one model execution: KL weights and the names handed out so far.

    kl_scale: weight of every site's KL (annealing times ``kl_weight``).
    mean_over_sites: for the ``mean`` reduction, the number of attention sites per pass L; each
        site's KL is then divided by its number of valid entries and by L. None: plain sum.
    record_weights: also record each layer's normalized weights W as ``pyro.deterministic``
        sites ``"<site>.weights"``, for ``Predictive``.
    """

    kl_scale: float = 1.0
    mean_over_sites: Optional[int] = None
    record_weights: bool = False
    calls: Counter = field(default_factory=Counter)

    def site_name(self, base: str) -> str:
        """``base`` on the first call of a module, ``base#2``, ``base#3`` ... on repeated calls
        (e.g. ALBERT's shared layer): every call is its own latent variable with its own KL."""
        self.calls[base] += 1
        count = self.calls[base]
        return base if count == 1 else f"{base}#{count}"

    def sample(self, name: str, prior: dist.TorchDistribution, info: AttentionSiteInfo, axis: AttentionAxis) -> Tensor:
        scale = self.kl_scale
        if self.mean_over_sites is not None:
            scale = scale / (self.mean_over_sites * max(info.num_valid(axis), 1))
        with poutine.scale(scale=scale):
            return pyro.sample(name, info.as_site_distribution(prior), infer={SITE_INFO: info})

    def record(self, name: str, weights: Tensor, event_dim: int) -> None:
        if self.record_weights:
            pyro.deterministic(f"{name}.weights", weights, event_dim=event_dim)


_ACTIVE: list[AttentionSites] = []


@contextmanager
def attention_sites(
    kl_scale: float = 1.0, mean_over_sites: Optional[int] = None, record_weights: bool = False
) -> Iterator[AttentionSites]:
    """Within this context, Bayesian attention layers are Pyro sample sites (see module doc)."""
    sites = AttentionSites(kl_scale, mean_over_sites, record_weights)
    _ACTIVE.append(sites)
    try:
        yield sites
    finally:
        _ACTIVE.pop()


def active_sites() -> Optional[AttentionSites]:
    return _ACTIVE[-1] if _ACTIVE else None


_SAMPLING: list[bool] = []


@contextmanager
def attention_sampling(enabled: bool = True) -> Iterator[None]:
    """Outside a Pyro model: draw attention from q even in eval mode (default there: the mean)."""
    _SAMPLING.append(enabled)
    try:
        yield
    finally:
        _SAMPLING.pop()


def sampling_requested() -> Optional[bool]:
    return _SAMPLING[-1] if _SAMPLING else None
