"""Amortized guides for models with Bayesian attention."""

from .attention import AttentionGuide

__all__ = ["AttentionGuide"]
