"""The distributions of the unnormalized attention weights S.

Variational q(S | Phi) and prior p(S | Psi), element-wise over attention entries. Both q's
are parameterized so that ``E_q[S] = exp(Phi)``: replacing S by its mean gives back softmax
attention. The contextual Gamma prior's shape is ``Psi * beta`` (mean ``Psi``) or ``Psi``
(``BamConfig.gamma_shape``); the fixed prior's parameters are constants.
"""

from __future__ import annotations

import math
from typing import Optional

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import constraints

from .config import BamConfig

EULER_GAMMA = 0.5772156649015329

#: Smallest Gamma shape used, contextual or fixed: keeps lgamma'(alpha) ~ -1/alpha finite in
#: float32 when ``Psi * beta`` underflows (beta=1e-15 times a tiny Psi), and the KL finite for a
#: fixed alpha that float32 rounds to 0, while the KL's gradient with respect to log(alpha)
#: stays ~ -1.
MIN_GAMMA_SHAPE = 1e-30


class MeanWeibull(dist.TorchDistribution):
    """Weibull(k, lam) given its log-mean Phi: ``lam = exp(Phi) / Gamma(1 + 1/k)``, k a scalar.

    The same law as ``torch.distributions.Weibull``, shaped for whole attention maps: it holds
    Phi itself (no full-size scale, 1/k or base-rate tensors) and draws in log space,
    ``log S = log lam + log(E) / k`` with ``E ~ Exp(1)``, so the sample's backward needs only S.
    """

    arg_constraints = {"log_mean": constraints.real}
    support = constraints.positive
    has_rsample = True

    def __init__(self, log_mean: Tensor, concentration: float, validate_args: Optional[bool] = None) -> None:
        self.log_mean, self.k = log_mean, float(concentration)
        #: log Gamma(1 + 1/k): log of the mean over the scale
        self.log_mean_factor = math.lgamma(1.0 + 1.0 / self.k)
        super().__init__(log_mean.shape, validate_args=validate_args)

    @property
    def log_scale(self) -> Tensor:
        return self.log_mean - self.log_mean_factor

    @property
    def scale(self) -> Tensor:
        return self.log_scale.exp()

    @property
    def concentration(self) -> Tensor:
        return self.log_mean.new_tensor(self.k).expand(self.batch_shape)

    @property
    def mean(self) -> Tensor:
        return self.log_mean.exp()

    @property
    def variance(self) -> Tensor:
        ratio = math.exp(math.lgamma(1.0 + 2.0 / self.k) - 2 * self.log_mean_factor)
        return self.log_mean.mul(2).exp() * (ratio - 1.0)

    def expand(self, batch_shape: torch.Size, _instance=None) -> "MeanWeibull":
        return MeanWeibull(self.log_mean.expand(batch_shape), self.k, validate_args=False)

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:
        # log S = Phi + (log E - k * log Gamma(1 + 1/k)) / k, with E = -log U, U ~ Uniform(0, 1]:
        # the shift is folded into the factor of -log U, so the noise costs one uniform draw and
        # three in-place passes (torch's exponential_ is several times slower on CPU)
        shape = self._extended_shape(sample_shape)
        noise = torch.empty(shape, dtype=self.log_mean.dtype, device=self.log_mean.device)
        shift = math.exp(-self.k * self.log_mean_factor)
        noise.uniform_(torch.finfo(noise.dtype).tiny, 1.0).log_().mul_(-shift).log_()
        if torch.is_grad_enabled() and self.log_mean.requires_grad:
            return torch.add(self.log_mean, noise, alpha=1.0 / self.k).exp_()
        # a draw (predictive): S in the noise's own buffer, the same values without a fresh map
        return torch.add(self.log_mean, noise, alpha=1.0 / self.k, out=noise).exp_()

    def log_prob(self, value: Tensor) -> Tensor:
        z = value.log() - self.log_scale  # log(s / lam)
        return math.log(self.k) - self.log_scale + (self.k - 1) * z - torch.exp(self.k * z)

    def entropy(self) -> Tensor:
        return EULER_GAMMA * (1 - 1 / self.k) + self.log_scale - math.log(self.k) + 1


def variational_distribution(phi: Tensor, config: BamConfig) -> dist.TorchDistribution:
    """q(S | Phi): Weibull(k, exp(Phi) / Gamma(1 + 1/k)) or LogNormal(Phi - sigma^2/2, sigma)."""
    if config.family == "weibull":
        return MeanWeibull(phi, config.k, validate_args=False)
    if config.family == "lognormal":
        sigma = config.sigma_q
        return dist.LogNormal(phi - 0.5 * sigma**2, phi.new_tensor(sigma).expand_as(phi), validate_args=False)
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
            alpha = like.new_tensor(max(config.alpha, MIN_GAMMA_SHAPE)).expand(shape)
        else:
            log_alpha = log_psi + math.log(config.beta) if config.gamma_shape == "psi_beta" else log_psi
            alpha = log_alpha.clamp_min(math.log(MIN_GAMMA_SHAPE)).exp().expand(shape)
        return dist.Gamma(alpha, like.new_tensor(config.beta).expand(shape), validate_args=False)
    if config.family == "lognormal":
        loc = like.new_tensor(config.mu_p) if log_psi is None else log_psi
        scale = like.new_tensor(config.sigma_p)
        return dist.LogNormal(loc.expand(shape), scale.expand(shape), validate_args=False)
    raise ValueError(f"variant {config.variant!r} has no prior distribution")
