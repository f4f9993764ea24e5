"""Bayesian attention: scores -> (stochastic) normalized attention weights.

One module, written against an :class:`~bam_pyro.axes.AttentionAxis`, serves dense and sparse
attention. Given scores ``f(Q, K)`` and the keys:

    Phi = log(softmax(scores) + 1e-20)                 normalized log-scores (reference code)
    S ~ q(S | Phi)  with  E[S] = exp(Phi)              Weibull or Lognormal
    W = softmax(log S)                                 normalized in log space
    prior: S ~ p(S | Psi),  Psi = softmax(F2(relu(F1(K))))   (contextual) or fixed
           (softmax over each query's keys or over all keys: ``BamConfig.prior_scope``)

Which S is used depends on where the layer runs:

- inside a Pyro model (:func:`~bam_pyro.sites.attention_sites`): S is a sample site with the
  prior; the guide replaces it with q (one shared forward pass). ``nokl`` has no prior, so its
  S is drawn from q as plain noise of the network;
- outside Pyro: in training mode S ~ q; in eval mode the point prediction substitutes S by its
  mean exp(Phi), which is exactly softmax attention, unless sampling is requested with
  :func:`~bam_pyro.sites.attention_sampling`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .axes import AttentionAxis
from .config import BamConfig
from .distributions import prior_distribution, variational_distribution
from .normalize import LOG_FLOOR, log_normalized, normalize
from .prior import ContextualPrior
from .sites import AttentionSiteInfo, active_sites, refuse_data_parallel_replica, sampling_requested

class BayesianAttention(nn.Module):
    """Turns attention scores into attention weights, stochastic as ``config`` says.

    ``num_heads`` and ``key_dim`` size the contextual prior network (unused otherwise).
    ``site_name`` names the Pyro sample site; :class:`~bam_pyro.model.BamModel` sets it to the
    module's qualified name.

    A query whose keys the axis masks all gets all-zero weights and no KL, rather than NaN (as
    PyTorch's ``scaled_dot_product_attention``) or a uniform weight over padding: see
    :class:`~bam_pyro.axes.DenseKeys`.
    """

    def __init__(self, config: BamConfig, num_heads: int, key_dim: int, site_name: str = "attention") -> None:
        super().__init__()
        if not isinstance(config, BamConfig):
            raise TypeError(f"config must be a BamConfig (e.g. BamConfig('wc')), got {config!r}")
        self.config = config
        self.site_name = site_name
        self.prior_net = (
            ContextualPrior(num_heads, key_dim, config.d_mid) if config.prior == "contextual" else None
        )

    def forward(self, scores: Tensor, keys: Optional[Tensor], axis: AttentionAxis) -> Tensor:
        """``scores``: entries laid out as ``axis`` expects; ``keys``: ``[..., keys, heads, key_dim]``
        (only read by the contextual prior). Returns normalized weights shaped like ``scores``."""
        refuse_data_parallel_replica(self)
        if not self.config.stochastic or self._predicts_mean():
            # E_q[S] = exp(Phi) normalizes to softmax(scores): the posterior-mean point prediction,
            # taken from the scores directly (no rounding through Phi, and no Phi to compute)
            return axis.softmax(scores)
        if scores.dtype in (torch.float16, torch.bfloat16):
            # float16 holds neither Phi's floor (1e-20) nor the KL's terms at the presets' extremes, and
            # bfloat16's 8-bit mantissa loses the KL's sums over many entries: the Bayesian part (Phi, S,
            # normalization, prior, KL) runs in float32, as autocast runs softmax, under bf16-mixed too,
            # and the weights return in the scores' dtype
            return self._bayesian_weights(scores.float(), keys, axis).to(scores.dtype)
        return self._bayesian_weights(scores, keys, axis)

    def _bayesian_weights(self, scores: Tensor, keys: Optional[Tensor], axis: AttentionAxis) -> Tensor:
        config = self.config
        phi = log_normalized(axis, scores)
        sites = active_sites()
        if sites is not None and config.prior is not None:
            name = sites.site_name(self.site_name)
            info = AttentionSiteInfo(phi, config, axis.mask, axis.event_dim)
            s = sites.sample(name, self.prior(phi, keys, axis), info, axis)
            weights = normalize(axis, s)
            sites.record(name, weights, axis.event_dim)
            return weights
        s = variational_distribution(phi, config).rsample()  # sampling outside a model's sites
        return normalize(axis, s)

    def _predicts_mean(self) -> bool:
        """No Pyro sites to serve and no draw asked for (eval mode, or ``attention_sampling(False)``)."""
        requested = sampling_requested()
        return active_sites() is None and not (self.training if requested is None else requested)

    def prior(self, phi: Tensor, keys: Optional[Tensor], axis: AttentionAxis):
        """p(S | keys), element-wise over the entries of ``phi``."""
        log_psi = None
        if self.prior_net is not None:
            if keys is None:
                raise ValueError("the contextual prior (lc, wc) needs the keys; got keys=None")
            if self.config.detach_prior_keys:
                keys = keys.detach()
            logits = self.prior_net(keys).to(phi.dtype)
            if self.config.prior_scope == "all_keys":
                log_psi = axis.spread(torch.log(axis.softmax_all_keys(logits) + LOG_FLOOR))
            else:
                log_psi = log_normalized(axis, axis.spread(logits))
        return prior_distribution(log_psi, self.config, phi.shape, phi)

    def extra_repr(self) -> str:
        c = self.config
        return f"variant={c.variant}, site={self.site_name!r}"
