"""Every KL divergence of Bayesian attention, and how the ELBO reaches it.

- :mod:`~bam_pyro.kl.closed_forms`: the closed forms entry by entry, KL(Weibull || Gamma) (also
  for q given by its log-mean Phi) and KL(LogNormal || LogNormal), registered with torch;
- :mod:`~bam_pyro.kl.summed`: the KL of one attention map, summed over its valid entries;
- :mod:`~bam_pyro.kl.rows`: the KL of a fused attention call, from row statistics, without its map.

The ELBO reaches them by calls, from ``TraceMeanField_ELBO``'s ``kl_divergence(q, p)`` at each
attention site (the guide's q is ``variational_distribution(Phi, config)``, the model's p the
layer's prior, both built from the layer's :class:`~bam_pyro.config.BamConfig`):

- a materialized map (:class:`~bam_pyro.attention_map.AttentionMap`):
  :func:`~bam_pyro.kl.summed.kl_attention_maps` -> :func:`~bam_pyro.kl.summed.summed_kl` -> the
  pair's summed closed form (:func:`~bam_pyro.kl.summed.summed_kl_mean_weibull_gamma`, which uses
  :func:`~bam_pyro.kl.closed_forms.weibull_gamma_constant`);
- a fused call: ``bam_pyro.fused_sites``' ``DotProductCall.kl`` ->
  :meth:`RowStatistics.kl <bam_pyro.kl.rows.RowStatistics.kl>` ->
  :func:`~bam_pyro.kl.rows.weibull_gamma_row_kl` or :func:`~bam_pyro.kl.rows.lognormal_row_kl`.
"""

from .closed_forms import compact, kl_lognormal_lognormal, kl_mean_weibull_gamma, kl_weibull_gamma, weibull_gamma_constant
from .rows import RowStatistics, lognormal_row_kl, weibull_gamma_row_kl
from .summed import (entrywise_summed_kl, kl_attention_maps, summed_kl, summed_kl_lognormal_lognormal,
                     summed_kl_mean_weibull_gamma)

__all__ = [
    "RowStatistics",
    "compact",
    "entrywise_summed_kl",
    "kl_attention_maps",
    "kl_lognormal_lognormal",
    "kl_mean_weibull_gamma",
    "kl_weibull_gamma",
    "lognormal_row_kl",
    "summed_kl",
    "summed_kl_lognormal_lognormal",
    "summed_kl_mean_weibull_gamma",
    "weibull_gamma_constant",
    "weibull_gamma_row_kl",
]
