"""The distributions of the unnormalized attention weights S.

Variational q(S | Phi) and prior p(S | Psi), element-wise over attention entries. Both q's
are parameterized so that ``E_q[S] = exp(Phi)``: replacing S by its mean gives back softmax
attention. The prior's mean is ``Psi`` (contextual) or a constant (fixed).
"""

from __future__ import annotations

import math
from typing import Optional

import pyro.distributions as dist
import torch
from torch import Tensor

from .config import BamConfig

#: Smallest Gamma shape used: keeps lgamma'(alpha) ~ -1/alpha finite in float32 when
#: ``Psi * beta`` underflows (beta=1e-15 times a tiny Psi), while the KL's gradient with
#: respect to log(alpha) stays ~ -1.
MIN_GAMMA_SHAPE = 1e-30


def variational_distribution(phi: Tensor, config: BamConfig) -> dist.TorchDistribution:
    """q(S | Phi): Weibull(k, exp(Phi) / Gamma(1 + 1/k)) or LogNormal(Phi - sigma^2/2, sigma)."""
    if config.family == "weibull":
        k = config.k
        scale = torch.exp(phi - math.lgamma(1.0 + 1.0 / k))
        return dist.Weibull(scale, scale.new_tensor(k).expand_as(scale), validate_args=False)
    if config.family == "lognormal":
        sigma = config.sigma_q
        return dist.LogNormal(
            phi - 0.5 * sigma**2, torch.full_like(phi, sigma), validate_args=False
        )
    raise ValueError(f"variant {config.variant!r} has no variational distribution")


def prior_distribution(
    log_psi: Optional[Tensor], config: BamConfig, shape: torch.Size, like: Tensor
) -> dist.TorchDistribution:
    """p(S): Gamma(alpha, beta) for Weibull q, LogNormal(mu, sigma_p) for Lognormal q.

    ``log_psi`` is the log of the contextual prior mean (None for a fixed prior); ``shape`` is the
    shape of the attention entries it must cover and ``like`` gives dtype and device.
    """
    if config.family == "weibull":
        if log_psi is None:
            alpha = like.new_tensor(config.alpha).expand(shape)
        else:
            log_alpha = log_psi + math.log(config.beta)
            alpha = log_alpha.clamp_min(math.log(MIN_GAMMA_SHAPE)).exp().expand(shape)
        return dist.Gamma(alpha, like.new_tensor(config.beta).expand(shape), validate_args=False)
    if config.family == "lognormal":
        loc = like.new_tensor(config.mu_p) if log_psi is None else log_psi
        scale = like.new_tensor(config.sigma_p)
        return dist.LogNormal(loc.expand(shape), scale.expand(shape), validate_args=False)
    raise ValueError(f"variant {config.variant!r} has no prior distribution")
