"""The ELBO of Deng et al. (2018) for one local categorical latent per target token, as they estimate it.

For alignments ``z_j`` independent across target positions given the decoder states (one
``Categorical`` site inside the target plates), the bound per token is

    ELBO_j = E_q(z_j)[log p(y_j | z_j)] - lambda * KL(q(z_j) || p(z_j))

with the KL computed exactly and the expectation either

- **enumerated** (the guide site has ``infer={"enumerate": "parallel"}``): ``sum_i q_ji log p(y_j | i)``,
  exact; or
- **sampled**, one ``z_j ~ q`` per token, with the paper's score-function gradient (their eq. 1)
  and the soft-attention likelihood ``B_j = log p(y_j | x, E_p[z_j])`` as baseline:

      surrogate_j = log p(y_j | z_j) + sg[log p(y_j | z_j) - B_j] * (log q(z_j) - sg[log q(z_j)])
                    - lambda * KL(q(z_j) || p(z_j))                                 (sg: stop-gradient)

  Its value is the single-sample ELBO (the score term is 0 in value); its gradient is
  ``grad log p(y_j | z_j) + (log p(y_j | z_j) - B_j) grad log q(z_j) - lambda grad KL``: the paper's
  estimator. With ``q = p`` (hard attention) the KL is 0 and this is REINFORCE on the Jensen bound
  ``E_p[log p(y | z)]``.

Pyro's ``TraceGraph_ELBO`` differs on three counts: it has no ``differentiable_loss``, it samples
the KL (``log p(z) - log q(z)`` in the reward) and it adds a squared-error loss that fits the
baseline. ``TraceEnum_ELBO`` covers the enumerated case but refuses a ``GuideMessenger``, which the
hard-attention guide is (q is the model's own attention, computed in the model's pass).

Scales and masks are Pyro's: each term carries its site's ``poutine.scale`` and ``poutine.mask``
(the objective's per-token weight on the likelihood, times lambda on the alignment sites), so
the loss equals ``TraceEnum_ELBO``'s wherever both apply. The model attaches the baseline to its
observed site as ``infer={"baseline": {"baseline_value": B}}`` (unscaled, ``[B, T]``): only the
model knows the soft likelihood, and its observed site is the one a replay against the guide's
trace leaves as the model wrote it (Pyro's ``TraceGraph_ELBO`` reads the same key from the guide's
latent site).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer import ELBO
from pyro.infer.enum import get_importance_trace  # undocumented: Pyro's ELBOs trace model and guide with it; no public twin (tests/test_private_names.py)
from torch import Tensor
from torch.distributions import kl_divergence


class AlignmentELBO(ELBO):
    """Negative ELBO of a model with one local categorical latent site (see module doc).

    A Pyro ``ELBO``: ``differentiable_loss(model, guide, *args, **kwargs)``, ``loss`` and
    ``loss_and_grads`` (so ``SVI(model, guide, pyro.optim.Adam(...), loss=AlignmentELBO())``
    trains with it). The guide may be a function or a ``GuideMessenger``. ``max_plate_nesting``: the model's plate dims
    (the enumeration dim is the one to their left). One particle: the estimator is the paper's.
    """

    def __init__(self, max_plate_nesting: int = 2) -> None:
        super().__init__(max_plate_nesting=max_plate_nesting)

    def _get_trace(self, model: Callable, guide: Callable, args: tuple, kwargs: dict) -> tuple:  # ELBO's hook for subclasses
        return get_importance_trace("flat", self.max_plate_nesting, model, guide, args, kwargs)

    def loss(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> float:
        with torch.no_grad():
            return float(self.differentiable_loss(model, guide, *args, **kwargs))

    def loss_and_grads(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> float:
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        loss.backward()
        return float(loss.detach())

    def differentiable_loss(self, model: Callable, guide: Callable, *args: Any, **kwargs: Any) -> Tensor:
        guide = poutine.enum(guide, first_available_dim=-1 - self.max_plate_nesting)
        model_trace, guide_trace = self._get_trace(model, guide, args, kwargs)
        latent = [site for site in guide_trace.nodes.values() if site["type"] == "sample" and not site["is_observed"]]
        observed = [site for site in model_trace.nodes.values() if site["type"] == "sample" and site["is_observed"]]
        if len(latent) != 1 or len(observed) != 1:
            raise ValueError(f"AlignmentELBO handles one latent and one observed site, got latent "
                             f"{[s['name'] for s in latent]} and observed {[s['name'] for s in observed]}")
        q_site, y_site = latent[0], observed[0]
        p_site = model_trace.nodes[q_site["name"]]
        if q_site["fn"].has_rsample:
            raise ValueError(f"site {q_site['name']!r} is reparameterized: use TraceMeanField_ELBO")

        kl = scale_and_mask(kl_divergence(q_site["fn"], p_site["fn"]), q_site["scale"], q_site["mask"])
        log_likelihood = y_site["log_prob"]  # scaled and masked: [S, B, T] enumerated, [B, T] sampled
        if q_site["infer"].get("_enumerate_dim") is not None:
            expected = (q_site["unscaled_log_prob"].exp() * log_likelihood).sum(0)
            return kl.sum() - expected.sum()
        baseline = (y_site["infer"].get("baseline") or {}).get("baseline_value")
        if baseline is None:
            raise ValueError(f"site {q_site['name']!r} is sampled but the model's observed site "
                             f"{y_site['name']!r} has no infer={{'baseline': {{'baseline_value': ...}}}}")
        reward = (log_likelihood - scale_and_mask(baseline, y_site["scale"], y_site["mask"])).detach()
        log_q = q_site["unscaled_log_prob"]
        score = reward * (log_q - log_q.detach())
        return kl.sum() - (log_likelihood + score).sum()
