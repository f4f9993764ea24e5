"""The amortized guide: q(S_l | Phi_l) at every Bayesian attention site, in the model's own pass.

A :class:`pyro.poutine.guide.GuideMessenger` runs the model once and, at each latent site,
replaces the prior by the posterior it returns. An attention site carries its scores Phi (see
:mod:`bam_pyro.sites`), so the guide needs no network of its own: the variational parameters
are the model's query/key projections, as in the paper, and one forward pass serves both the
guide and the model (same dropout masks, nothing computed twice).
"""

from __future__ import annotations

from typing import Optional

import pyro.distributions as dist
from pyro.poutine.guide import GuideMessenger

from .distributions import variational_distribution
from .sites import SITE_INFO, AttentionSiteInfo


class AttentionGuide(GuideMessenger):
    """Guide for the Bayesian attention sites of a model.

    Every other latent site is drawn from the model itself: in posterior prediction that is
    exactly what an unobserved target needs (``y ~ p(y | x, S)`` with S from q). Use it as any
    guide, ``TraceMeanField_ELBO().differentiable_loss(model, guide, *args)`` or
    ``Predictive(model, guide=guide, ...)``; calling it runs the model under the guide and returns
    every site's value.
    """

    _site: Optional[AttentionSiteInfo] = None

    def _pyro_sample(self, msg) -> None:
        self._site = (msg["infer"] or {}).get(SITE_INFO)
        super()._pyro_sample(msg)

    def get_posterior(self, name: str, prior: dist.TorchDistribution) -> dist.TorchDistribution:
        site = self._site
        if site is None:
            return prior
        return site.as_site_distribution(variational_distribution(site.phi, site.config))
