"""Guides of the latent-alignment variants: none (exact), the model's own prior (hard), the
inference network's posterior (va-*), and va-relaxed's Jensen warm start."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.poutine.enum_messenger import EnumMessenger
from pyro.poutine.guide import GuideMessenger
from pyro.poutine.runtime import _PYRO_STACK  # private: Pyro has no public way to ask whether enumeration is on (tests/test_private_names.py)
import torch
from torch import Tensor

from ..validation import whole_number

from .distributions import MaskedDirichlet, dirichlet_concentration
from .model import ALIGNMENT, LatentAlignmentModel, masked_scores


def no_guide(*args: Any, **kwargs: Any) -> None:
    """The guide of ``exact``: no latent site (``TraceEnum_ELBO`` sums the alignment out in the model).

    Outside enumeration an empty guide is silently wrong, so it raises: ``Trace_ELBO`` would draw
    the alignment from the model's prior and fit ``E_p[log p(y | z)]`` without the prior's score term
    (Pyro only warns), and ``Predictive`` would return prior draws as the alignment posterior.
    """
    if not any(isinstance(handler, EnumMessenger) for handler in _PYRO_STACK):
        raise ValueError("the exact variant's alignment is summed out by enumeration: train it with "
                         "TraceEnum_ELBO (elbo_for('exact')); for posterior draws call model.posterior_alignments, "
                         "for prior draws Predictive(model.model) without a guide")


class PriorGuide(GuideMessenger):
    """q(z | x, y) = p(z | x, y_<j): every latent site drawn from the model's own distribution, in the
    model's forward pass (hard attention; with the site enumerated, its exact expectation)."""

    def get_posterior(self, name: str, prior: dist.TorchDistribution) -> dist.TorchDistribution:
        return prior


def variational_posterior(model: LatentAlignmentModel, src: Tensor, src_mask: Tensor, tgt_mask: Tensor,
                          tgt_out: Optional[Tensor]) -> dist.TorchDistribution:
    """q(z_j | x, y) ``[B, T]`` of ``model.inference``: Dirichlet (``va-relaxed``) or categorical, padded
    sources at probability 0."""
    if tgt_out is None:
        raise ValueError("the variational guide reads the target: pass tgt_out")
    scores = model.inference(src, src_mask, tgt_out, tgt_mask)
    source_mask = src_mask.unsqueeze(-2)
    if model.spec.relaxed:
        return MaskedDirichlet(dirichlet_concentration(scores), source_mask)
    return dist.Categorical(logits=masked_scores(scores, source_mask))


class VariationalAlignmentGuide:
    """q(z_j | x, y) from ``model.inference`` at the model's alignment site, in the model's plates with
    the model's KL weight; enumerated (``va-enum``), sampled (``va-sample``) or Dirichlet (``va-relaxed``).
    A plain guide rather than a ``GuideMessenger``: ``TraceEnum_ELBO`` enumerates only plain guides."""

    def __init__(self, model: LatentAlignmentModel) -> None:
        if model.inference is None:
            raise ValueError(f"variant {model.config.variant!r} has no inference network")
        self.model = model

    def __call__(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor,
                 tgt_out: Optional[Tensor] = None, step: Optional[int] = None) -> Tensor:
        model = self.model
        q = variational_posterior(model, src, src_mask, tgt_mask, tgt_out)
        infer = {"enumerate": "parallel"} if model.spec.enumerate else {}
        with model.target_plates(tgt_mask), poutine.scale(scale=model.kl_scale(step)):
            return pyro.sample(ALIGNMENT, q, infer=infer)


class JensenWarmStart(GuideMessenger):
    """``va-relaxed`` fit first by the Jensen bound ``E_p[log p(y | x, z)]`` (q = p, no KL) for
    ``warm_steps`` SVI steps of the model, then by the ELBO with q from the inference network.

    Deng et al. (2018, section 3 and Algorithm 2) pretrain the relaxed model so: trained with the
    inference network from the start, the Dirichlet q and p drift to the centre of the simplex, where
    the KL is small, and the alignments stay near uniform. The phase is read from the training step
    that the loop passes to model and guide (``step=t``; ``SVITrainer`` saves it), so a resumed run is
    in the phase it left; outside training (no ``step``) the warm start is over. One forward pass of
    the model serves both phases (q = p is the model's own distribution at its site).
    """

    def __init__(self, model: LatentAlignmentModel, warm_steps: int) -> None:
        if not model.spec.relaxed:
            raise ValueError(f"the Jensen warm start is va-relaxed's (Deng et al.'s Algorithm 2), "
                             f"not {model.config.variant!r}'s")
        whole_number("warm_steps", warm_steps, minimum=0)
        super().__init__(model.model)
        self.alignment_model, self.warm_steps = model, warm_steps

    def warming(self, step: Optional[int]) -> bool:
        """Whether training step ``step`` is in the warm start (None: outside training, it is not)."""
        if step is None:
            model = self.alignment_model
            if self.warm_steps and model.training and torch.is_grad_enabled():
                raise ValueError("va-relaxed's Jensen warm start reads the training step: pass it, guide(..., step=t)")
            return False
        return step < self.warm_steps

    def get_posterior(self, name: str, prior: dist.TorchDistribution) -> dist.TorchDistribution:
        args, kwargs = self.args_kwargs
        inputs = inspect.signature(self.alignment_model.model).bind(*args, **kwargs).arguments
        if name != ALIGNMENT or self.warming(inputs.get("step")):
            return prior
        return variational_posterior(self.alignment_model, inputs["src"], inputs["src_mask"], inputs["tgt_mask"],
                                     inputs.get("tgt_out"))


def guide_for(model: LatentAlignmentModel, warm_steps: int = 0) -> Callable:
    """The guide of the model's variant (see module doc); ``warm_steps`` > 0: va-relaxed's
    :class:`JensenWarmStart` for that many SVI steps."""
    kind = model.spec.guide
    if warm_steps:
        return JensenWarmStart(model, warm_steps)
    if kind == "none":
        return no_guide
    if kind == "prior":
        return PriorGuide(model.model)
    return VariationalAlignmentGuide(model)
