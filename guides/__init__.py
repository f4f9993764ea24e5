"""Guides with networks of their own (inference networks that read more than the model does).

The generic amortized attention guide needs no network: it is :class:`bam_pyro.AttentionGuide`.
"""
