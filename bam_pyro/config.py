"""Configuration of Bayesian attention: the six variants of the paper and their hyperparameters.

Everything is validated on construction so that a typo or an impossible value fails at once,
with a message that names the field, instead of producing NaNs many steps later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, get_args

from .validation import is_number, positive, require, whole_number

Variant = Literal["soft", "nokl", "lf", "lc", "wf", "wc"]
Family = Literal["weibull", "lognormal"]
PriorKind = Literal["fixed", "contextual"]
Reduction = Literal["mean", "sum"]
GammaShape = Literal["psi_beta", "psi"]
GAMMA_SHAPES: tuple[str, ...] = get_args(GammaShape)
PriorScope = Literal["query_keys", "all_keys"]
PRIOR_SCOPES: tuple[str, ...] = get_args(PriorScope)

#: variant name -> (variational family, prior kind); ``None`` where the variant has none.
VARIANTS: dict[str, tuple[Optional[Family], Optional[PriorKind]]] = {
    "soft": (None, None),  # deterministic softmax attention
    "nokl": ("weibull", None),  # stochastic attention, no prior term
    "lf": ("lognormal", "fixed"),
    "lc": ("lognormal", "contextual"),
    "wf": ("weibull", "fixed"),
    "wc": ("weibull", "contextual"),
}


#: Largest Lognormal scale of q: its samples ``S = exp(Phi - sigma_q^2/2 + sigma_q * eps)`` lie
#: around ``exp(-sigma_q^2/2)``, which from about 13 on underflows to 0 in float32 (the weights
#: turn uniform and lose their gradient). The prior's sigma_p has no bound: only the KL reads it.
MAX_SIGMA_Q = 10.0


@dataclass(frozen=True)
class BamConfig:
    """Hyperparameters of one Bayesian attention module.

    variant: ``soft`` | ``nokl`` | ``lf`` | ``lc`` | ``wf`` | ``wc`` (family letter, prior letter).
    k: Weibull shape of q; larger is less noisy (k -> inf recovers softmax attention).
    sigma_q: Lognormal scale of q (sigma_q -> 0 recovers softmax attention), at most
        :data:`MAX_SIGMA_Q`.
    sigma_p: Lognormal scale of the prior.
    mu_p: location of the fixed Lognormal prior (``lf`` only).
    beta: rate of the Gamma prior.
    alpha: shape of the fixed Gamma prior (``wf`` only).
    gamma_shape: shape of the contextual Gamma prior. ``psi_beta`` (the reference code):
        ``alpha = Psi * beta``, so the prior's mean is ``Psi``; the KL's terms in q are then
        ``beta * (exp(Phi) - Psi * Phi)``, a pull of the attention towards ``Psi`` that vanishes
        with beta. ``psi`` (the paper's text): ``alpha = Psi``; the KL's terms in q are
        ``beta * exp(Phi) - Psi * Phi``, a cross-entropy from the prior ``Psi`` to the attention
        ``W = exp(Phi)`` that stays whatever beta is (beta then only scales the ``exp(Phi)`` term).
    prior_scope: which keys the contextual prior mean Psi is a softmax over. ``query_keys``: each
        query's own keys, so that Psi sums to one where the attention ``exp(Phi)`` does.
        ``all_keys`` (the paper's text and reference code): every key of the attention call at
        once, one "global importance" per key shared by all queries. The two agree for dense
        attention with key padding only; they differ under causal masks and on graphs, where the
        keys of ``all_keys`` are all nodes: there, with ``alpha = Psi * beta``, the KL's
        ``-log Psi`` per edge trains the prior network to tell how often each node is a neighbour.
    d_mid: hidden width of the contextual prior network ``F2(relu(F1(K)))``.
    detach_prior_keys: stop the KL's gradient at the contextual prior's input, so that the prior
        network learns from the keys without reshaping them. With a small Gamma shape
        ``alpha = Psi * beta`` the KL holds ``-log Psi`` per entry, whose pull on the keys can
        outweigh the likelihood's gradient in a pretrained encoder (see ``experiments.glue``).
    """

    variant: Variant = "wc"
    k: float = 1.0
    sigma_q: float = 1.0
    sigma_p: float = 1.0
    mu_p: float = 0.0
    beta: float = 1.0
    alpha: float = 1.0
    gamma_shape: GammaShape = "psi_beta"
    prior_scope: PriorScope = "query_keys"
    d_mid: int = 1
    detach_prior_keys: bool = False

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(
                f"unknown BAM variant {self.variant!r}; expected one of {sorted(VARIANTS)}"
            )
        for name in ("k", "sigma_q", "sigma_p", "beta", "alpha"):
            positive(name, getattr(self, name))
        if self.sigma_q > MAX_SIGMA_Q:
            raise ValueError(
                f"sigma_q must be <= {MAX_SIGMA_Q}, got {self.sigma_q!r}: q's samples "
                "exp(Phi - sigma_q^2/2 + sigma_q * eps) underflow to 0 beyond it (uniform weights, no gradient)"
            )
        require(is_number(self.mu_p) and math.isfinite(self.mu_p), "mu_p", self.mu_p, "a finite number")
        if self.gamma_shape not in GAMMA_SHAPES:
            raise ValueError(f"gamma_shape must be one of {GAMMA_SHAPES}, got {self.gamma_shape!r}")
        if self.prior_scope not in PRIOR_SCOPES:
            raise ValueError(f"prior_scope must be one of {PRIOR_SCOPES}, got {self.prior_scope!r}")
        whole_number("d_mid", self.d_mid)
        if not isinstance(self.detach_prior_keys, bool):
            raise ValueError(f"detach_prior_keys must be True or False, got {self.detach_prior_keys!r}")

    @property
    def family(self) -> Optional[Family]:
        """Variational family of the unnormalized weights S, or None for soft attention."""
        return VARIANTS[self.variant][0]

    @property
    def prior(self) -> Optional[PriorKind]:
        """Kind of prior on S, or None when there is no KL term (soft, nokl)."""
        return VARIANTS[self.variant][1]

    @property
    def stochastic(self) -> bool:
        return self.family is not None

    def replace(self, **changes: Any) -> "BamConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class ObjectiveConfig:
    """How the ELBO is reduced and how the KL term is weighted over training.

    reduction:
        ``mean`` (the reference code, and what the paper's hyperparameters assume): the loss is
        mean negative log-likelihood + ``kl_weight * lambda_t * KL_mean``, where KL_mean is the KL
        averaged over the valid attention entries of each site and then over sites.
        ``sum``: the plain ELBO, summed log-likelihood minus ``lambda_t * kl_weight * sum of KLs``.
    kl_weight: the paper's ``att_kl`` weight on the KL term.
    anneal_rate: rho in ``lambda_t = sigmoid(t * rho)``; None disables annealing (lambda_t = 1).
    """

    reduction: Reduction = "mean"
    kl_weight: float = 1.0
    anneal_rate: Optional[float] = None

    def __post_init__(self) -> None:
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {self.reduction!r}")
        positive("kl_weight", self.kl_weight)
        positive("anneal_rate", self.anneal_rate, optional=True)

    def kl_annealing(self, step: int) -> float:
        """lambda_t = sigmoid(t * rho); never 0, so ``poutine.scale`` accepts it."""
        if self.anneal_rate is None:
            return 1.0
        return 1.0 / (1.0 + math.exp(-step * self.anneal_rate))
