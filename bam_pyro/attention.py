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

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from .axes import AttentionAxis
from .config import BamConfig
from .distributions import prior_distribution, variational_distribution
from .fused_sites import DotProductCall, FusedPrior, FusedSiteInfo, softmax_attention
from .noise import draw_seeds
from .normalize import LOG_FLOOR, log_normalized, normalize
from .prior import ContextualPrior
from .sites import AttentionSiteInfo, active_sites, refuse_data_parallel_replica, sampling_requested

class DotProductInputs(NamedTuple):
    """What the fused path takes in place of the scores (see :meth:`BayesianAttention.attend`)."""

    query: Tensor
    key: Tensor
    value: Tensor
    key_mask: Optional[Tensor]
    query_mask: Optional[Tensor]
    batch_dims: int
    causal: bool
    dropout: float


class BayesianAttention(nn.Module):
    """Turns attention scores into attention weights, stochastic as ``config`` says.

    ``num_heads`` and ``key_dim`` size the contextual prior network (unused otherwise).
    ``site_name`` names the Pyro sample site; :class:`~bam_pyro.model.BamModel` sets it to the
    module's qualified name.

    A query whose keys the axis masks all gets all-zero weights and no KL, rather than NaN (as
    PyTorch's ``scaled_dot_product_attention``) or a uniform weight over padding: see
    :class:`~bam_pyro.axes.DenseKeys`.

    Dot-product callers can take the fused path instead, :meth:`attend` (no attention map in
    memory, :mod:`bam_pyro.fused`); ``fused = False`` (:func:`set_fused`) keeps
    them on the materialized one.
    """

    #: whether dot-product callers use :meth:`attend` (see :meth:`uses_fused_path`)
    fused: bool = True

    def __init__(self, config: BamConfig, num_heads: int, key_dim: int, site_name: str = "attention") -> None:
        super().__init__()
        if not isinstance(config, BamConfig):
            raise TypeError(f"config must be a BamConfig (e.g. BamConfig('wc')), got {config!r}")
        self.config = config
        self.site_name = site_name
        self.prior_net = (
            ContextualPrior(num_heads, key_dim, config.d_mid) if config.prior == "contextual" else None
        )

    def forward(self, scores: "Tensor | DotProductInputs", keys: Optional[Tensor], axis: Optional[AttentionAxis]) -> Tensor:
        """``scores``: entries laid out as ``axis`` expects; ``keys``: ``[..., keys, heads, key_dim]``
        (only read by the contextual prior). Returns normalized weights shaped like ``scores``.
        Given :class:`DotProductInputs` instead (from :meth:`attend`), returns the fused path's output."""
        refuse_data_parallel_replica(self)
        if self.config.stochastic and torch.jit.is_tracing():
            raise RuntimeError(
                "Bayesian attention does not run under torch.jit.trace (Pyro's JitTrace_ELBO, JitTraceMeanField_ELBO): "
                "it decides per call on the host (masks, normalization), which a trace would freeze; use "
                "TraceMeanField_ELBO or bam_pyro.elbo.AttentionMeanFieldELBO, and torch.compile for speed")
        if isinstance(scores, DotProductInputs):
            return self._fused(scores, keys)
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
            info = AttentionSiteInfo(phi, config, axis.mask, axis.event_dim)
            s = sites.declare(self, self.prior(phi, keys, axis), info, axis)
            weights = normalize(axis, s)
            if sites.record_weights:
                sites.record(weights, axis.event_dim)
            return weights
        s = variational_distribution(phi, config).rsample()  # sampling outside a model's sites
        return normalize(axis, s)

    def uses_fused_path(self) -> bool:
        """Whether a dot-product caller should call :meth:`attend`: the fused path is on and no
        attention site records its weights (``Predictive`` asking for maps gets them materialized)."""
        sites = active_sites()
        return self.fused and not (sites is not None and sites.record_weights)

    def attend(self, query: Tensor, key: Tensor, value: Tensor, *, keys: Optional[Tensor] = None,
               key_mask: Optional[Tensor] = None, query_mask: Optional[Tensor] = None, batch_dims: int = 1,
               causal: bool = False, dropout: float = 0.0) -> Tensor:
        """The fused path: attention output ``[..., H, Lq, dv]`` of dot-product scores ``query . key``
        (``query`` ``[..., H, Lq, d]`` already scaled, ``key``/``value`` ``[..., H, Lk, d]``) without
        the attention map. ``keys``: the contextual prior's input ``[..., Lk, H, key_dim]``;
        ``key_mask`` ``[..., 1 or H, 1, Lk]`` and ``query_mask`` ``[..., 1 or H, Lq, 1]`` (True = valid);
        ``batch_dims``: data-batch dims before the heads (in the site's event); ``causal``: query i
        sees keys j <= i; ``dropout``: attention dropout, applied (the caller passes 0 in eval mode).

        The point prediction (eval mode) and soft attention are ``scaled_dot_product_attention``;
        a draw is :class:`~bam_pyro.fused_sites.DotProductCall` with the seed of the site (or a fresh
        one outside a model). Without a guide the site draws S from the prior, as a full map.
        Runs as a call of the module (its hooks see it), with :class:`DotProductInputs`."""
        inputs = DotProductInputs(query, key, value, key_mask, query_mask, batch_dims, causal, dropout)
        return self(inputs, keys, None)

    def _fused(self, inputs: "DotProductInputs", keys: Optional[Tensor]) -> Tensor:
        query, key, value, key_mask, query_mask, batch_dims, causal, dropout = inputs
        if not self.config.stochastic or self._predicts_mean():
            return softmax_attention(query, key, value, key_mask, causal, dropout)
        if query.dtype == torch.float16:  # as on the materialized path: the Bayesian part in float32
            floats = inputs._replace(query=query.float(), key=key.float(), value=value.float())
            return self._fused(floats, keys).to(query.dtype)
        sites = active_sites()
        has_site = sites is not None and self.config.prior is not None
        logits = self._prior_logits(keys, query.dtype).transpose(-1, -2) if has_site and self.prior_net is not None else None
        call = DotProductCall(self.config, query, key, value, key_mask=key_mask, query_mask=query_mask, causal=causal,
                              batch_dims=batch_dims, prior_logits=logits, dropout=dropout,
                              build_prior=lambda phi, axis: self.prior(phi, keys, axis))
        if not has_site:
            return call.attend(draw_seeds(call.sample_shape, device=query.device))
        drawn = sites.declare(self, FusedPrior(call, call.sample_shape), FusedSiteInfo(call), None)
        if drawn.is_floating_point():  # S drawn from the prior (no guide): normalized as a map
            weights = normalize(call.axis(), drawn)
            return torch.nn.functional.dropout(weights, dropout) @ value
        return call.attend(drawn)

    def _predicts_mean(self) -> bool:
        """No Pyro sites to serve and no draw asked for (eval mode, or ``attention_sampling(False)``)."""
        requested = sampling_requested()
        return active_sites() is None and not (self.training if requested is None else requested)

    def prior(self, phi: Tensor, keys: Optional[Tensor], axis: AttentionAxis):
        """p(S | keys), element-wise over the entries of ``phi``."""
        log_psi = None
        if self.prior_net is not None:
            logits = self._prior_logits(keys, phi.dtype)
            if self.config.prior_scope == "all_keys":
                log_psi = axis.spread(torch.log(axis.softmax_all_keys(logits) + LOG_FLOOR))
            else:
                log_psi = log_normalized(axis, axis.spread(logits))
        return prior_distribution(log_psi, self.config, phi.shape, phi)

    def _prior_logits(self, keys: Optional[Tensor], dtype: torch.dtype) -> Tensor:
        """The contextual prior's logits ``[..., keys, heads]``."""
        if keys is None:
            raise ValueError("the contextual prior (lc, wc) needs the keys; got keys=None")

        def logits() -> Tensor:
            return self.prior_net(keys.detach() if self.config.detach_prior_keys else keys)

        sites = active_sites()
        return (logits() if sites is None else sites.once_per_keys(self, keys, logits)).to(dtype)

    def extra_repr(self) -> str:
        c = self.config
        return f"variant={c.variant}, site={self.site_name!r}"


def set_fused(model: nn.Module, enabled: bool) -> nn.Module:
    """Use (or stop using) the fused path in every :class:`BayesianAttention` of ``model``, where
    its scores allow; returns the model. The materialized path stays available for any model."""
    for module in model.modules():
        if isinstance(module, BayesianAttention):
            module.fused = bool(enabled)
    return model
