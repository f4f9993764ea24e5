"""The amortized guide: q(S_l | Phi_l) at every Bayesian attention site, in the model's own pass.

A :class:`pyro.poutine.guide.GuideMessenger` runs the model once and, at each latent site,
replaces the prior by the posterior it returns. An attention site carries its scores Phi (see
:mod:`bam_pyro.sites`), so the guide needs no network of its own: the variational parameters
are the model's query/key projections, as in the paper, and one forward pass serves both the
guide and the model (same dropout masks, nothing computed twice).

Other latent variables of a model (a global scale, Bayesian weights) get their posterior from a
guide messenger that :class:`AttentionGuide` is combined with, such as Pyro's autoguide messengers,
still in the one pass::

    class Guide(AttentionGuide, AutoNormalMessenger):
        "q(S | Phi) at the attention sites, a mean-field Normal at every other latent site."
"""

from __future__ import annotations

from typing import Any, Callable

import pyro.distributions as dist
from pyro.poutine.guide import GuideMessenger

from .model import TARGET
from .sites import SITE_INFO


class AttentionGuide(GuideMessenger):
    """Guide for the Bayesian attention sites of a model.

    At an attention site the posterior is q(S | Phi). The targets a :class:`~bam_pyro.BamModel`
    declares with ``observe`` are drawn from the model itself when unobserved: in posterior
    prediction that is exactly what they need (``y ~ p(y | x, S)`` with S from q). Any other latent
    site goes to the guide class combined after this one (``class Guide(AttentionGuide,
    AutoNormalMessenger)``: its ``get_posterior``, parameters and initialization); alone, the
    guide draws it from the model too.

    Use it as any guide, ``TraceMeanField_ELBO().differentiable_loss(model, guide, *args)``,
    ``pyro.infer.SVI(model, guide, optim, loss)`` or ``Predictive(model, guide=guide, ...)``;
    calling it runs the model under the guide and returns every site's value.
    """

    def __init__(self, model: Callable, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        self._infer: dict = {}  # the ``infer`` dict of the site being drawn, for get_posterior

    def _pyro_sample(self, msg) -> None:  # the handler Pyro's Messenger subclasses override (tests/test_private_names.py)
        self._infer = msg["infer"] or {}
        super()._pyro_sample(msg)

    def get_posterior(self, name: str, prior: dist.TorchDistribution) -> Any:
        site = self._infer.get(SITE_INFO)
        if site is not None:
            return site.posterior()
        if self._infer.get(TARGET):
            return prior
        return self.get_other_posterior(name, prior)

    def get_other_posterior(self, name: str, prior: dist.TorchDistribution) -> Any:
        """The posterior of a latent site that is neither attention nor target: the combined
        guide's, or the prior when there is none."""
        combined = super().get_posterior
        if combined.__func__ is GuideMessenger.get_posterior:  # abstract: nothing combined
            return prior
        return combined(name, prior)
