"""bam-pyro: Bayesian Attention Modules (Fan et al., NeurIPS 2020) in Pyro."""

from . import kl  # noqa: F401  (registers the closed-form KL divergences)
from .attention import BayesianAttention
from .axes import AttentionAxis, DenseKeys
from .config import VARIANTS, BamConfig, ObjectiveConfig
from .dense import MultiHeadBayesianAttention
from .guide import AttentionGuide
from .distributions import prior_distribution, variational_distribution
from .model import BamModel
from .prior import ContextualPrior
from .sites import attention_sampling, attention_sites

__all__ = [
    "VARIANTS",
    "AttentionAxis",
    "AttentionGuide",
    "BamConfig",
    "BamModel",
    "BayesianAttention",
    "ContextualPrior",
    "DenseKeys",
    "MultiHeadBayesianAttention",
    "ObjectiveConfig",
    "attention_sampling",
    "attention_sites",
    "prior_distribution",
    "variational_distribution",
]
