"""Uncertainty metrics, ArviZ diagnostics, plots and result tables."""
