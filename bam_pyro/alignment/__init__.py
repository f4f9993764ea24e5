"""The latent-alignment family of Deng et al. (2018), "Latent Alignment and Variational
Attention", as Pyro models and guides beside Bayesian attention: exact marginal, hard attention
(sampled or enumerated), variational attention (enumerated, sampled, relaxed). The alignment
network and the inference network are the user's (see :class:`AlignmentNetwork`)."""

from .distributions import MaskedDirichlet, TokensGivenAlignment, dirichlet_concentration
from .elbo import AlignmentELBO
from .guides import JensenWarmStart, PriorGuide, VariationalAlignmentGuide, guide_for, no_guide
from .model import (
    ALIGNMENT,
    ALIGNMENT_VARIANTS,
    AlignmentConfig,
    AlignmentNetwork,
    LatentAlignmentModel,
    elbo_for,
    masked_scores,
    teacher_forced_perplexity,
)
from .plates import target_plates

__all__ = [
    "ALIGNMENT",
    "ALIGNMENT_VARIANTS",
    "AlignmentConfig",
    "AlignmentELBO",
    "AlignmentNetwork",
    "JensenWarmStart",
    "LatentAlignmentModel",
    "MaskedDirichlet",
    "PriorGuide",
    "TokensGivenAlignment",
    "VariationalAlignmentGuide",
    "dirichlet_concentration",
    "elbo_for",
    "guide_for",
    "masked_scores",
    "no_guide",
    "target_plates",
    "teacher_forced_perplexity",
]
