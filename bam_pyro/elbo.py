"""A ``TraceMeanField_ELBO`` that scores attention sites by their analytic KL only.

Before computing a loss, Pyro evaluates ``log p`` at every model site and ``log q`` (with its
entropy) at every guide site, even where ``TraceMeanField_ELBO`` then uses the closed-form KL
instead. For attention sites these are several full attention maps per layer, built with
gradients and alive until the loss is returned: on a 6-layer MiniLM (batch 16, length 128) they
cost about 0.8 GB of peak memory and a large share of the step time, and the loss never reads
them. This ELBO leaves them out; everything else is ``TraceMeanField_ELBO`` unchanged.

Pyro's validation (on by default) is kept: a validated call runs the checks of
``TraceMeanField_ELBO`` (model and guide match, site shapes, reparameterization, mean-field
order), reading the shapes of attention sites from the guide's densities, which it computes
for that purpose. They concern the structure of the traces, which does not change from one
training step to the next, so with ``validate_once`` (the default) only the first call runs them
and later calls skip them, together with the guide's unused densities.

Under ``torch.compile`` of a whole step (``torch.compile`` of a function that calls
``differentiable_loss``), the network's pass is compiled and the ELBO's bookkeeping runs eagerly:
reading the traces, the densities of the targets and the sum of the KLs and log-likelihoods. Compiled,
Pyro's code there recompiled at every step until Dynamo's recompile limit: the
frame guards on values that change from step to step, the identity of the target's fresh
``Categorical`` (``Categorical.log_prob`` compares ``id(self)``), each site's KL weight as a float
(``is_identically_one(scale)``; annealing changes it every step) and the loss's ``.item()``.
"""

from __future__ import annotations

import pyro
import torch
from pyro import poutine
from pyro.infer import TraceMeanField_ELBO
from pyro.infer.trace_mean_field_elbo import _check_mean_field_requirement  # private: the parent's own check, no public twin (tests/test_private_names.py)
from pyro.infer.util import is_validation_enabled
from pyro.poutine.guide import GuideMessenger
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape

from .sites import SITE_INFO


def _scored(name: str, site: dict) -> bool:
    """Sites whose log-density the loss reads: all but attention sites (whose KL is analytic)."""
    return SITE_INFO not in (site.get("infer") or {})


class AttentionMeanFieldELBO(TraceMeanField_ELBO):
    """``TraceMeanField_ELBO`` without the unused log-densities of attention sites.

    Applies to guides that are :class:`~pyro.poutine.guide.GuideMessenger` (such as
    :class:`~bam_pyro.guide.AttentionGuide`); any other guide takes the parent's path. The analytic KL of
    every attention pair is registered by :mod:`bam_pyro.kl`, so the loss equals the parent's.
    """

    def __init__(self, *args, validate_once: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.validate_once = validate_once
        self._validated = False

    def differentiable_loss(self, model, guide, *args, **kwargs):
        if self.validate_once and self._validated:
            with pyro.validation_enabled(False):
                return super().differentiable_loss(model, guide, *args, **kwargs)
        loss = super().differentiable_loss(model, guide, *args, **kwargs)
        self._validated = is_validation_enabled()
        return loss

    def _get_trace(self, model, guide, args, kwargs):  # ELBO's hook for subclasses (tests/test_private_names.py)
        messenger = poutine.unwrap(guide)
        if not isinstance(messenger, GuideMessenger):
            return super()._get_trace(model, guide, args, kwargs)
        guide(*args, **kwargs)  # the network's pass: compiled code under torch.compile
        return self._checked_traces(messenger)

    @torch.compiler.disable  # eager: Pyro's bookkeeping (see the module doc, torch.compile)
    def _checked_traces(self, messenger: GuideMessenger) -> tuple[Trace, Trace]:
        """Model and guide trace of the pass ``messenger`` just ran, pruned, validated and with the
        densities the loss reads."""
        model_trace, guide_trace = messenger.get_traces()
        messenger.trace = Trace()  # else it holds every site's Phi, S and prior until the next step
        validate = is_validation_enabled()
        if validate:
            check_model_guide_match(model_trace, guide_trace, self.max_plate_nesting)
        model_trace = prune_subsample_sites(model_trace)
        guide_trace = prune_subsample_sites(guide_trace)
        model_trace.compute_log_prob(site_filter=_scored)
        latent = [s for n, s in guide_trace.nodes.items() if s["type"] == "sample"]
        if validate or any(_scored(s["name"], s) for s in latent):
            # validation checks every guide site's score parts; other latent sites may need the
            # Monte Carlo path
            guide_trace.compute_score_parts()
        if validate:
            for site in model_trace.nodes.values():
                if site["type"] == "sample" and _scored(site["name"], site):
                    check_site_shape(site, self.max_plate_nesting)
            for site in latent:
                check_site_shape(site, self.max_plate_nesting)
            check_if_enumerated(guide_trace)
            _check_mean_field_requirement(model_trace, guide_trace)
        return model_trace, guide_trace

    @torch.compiler.disable  # eager: Pyro's bookkeeping (see the module doc, torch.compile)
    def _differentiable_loss_particle(self, model_trace, guide_trace):  # the parent's hook (tests/test_private_names.py)
        return super()._differentiable_loss_particle(model_trace, guide_trace)
