"""One fused attention call as one Pyro sample site: its value is the call's noise seed.

On the fused path (:mod:`bam_pyro.fused`) the attention weights never exist as a tensor, so the
site cannot hold them. It holds what determines them instead: the int64 seed of the counter-based
noise (:mod:`bam_pyro.noise`), one per draw. Given the scores, the seed fixes every weight of the
call, so q(seed) is q(S | Phi) written through its noise, as a reparameterized sample is:

- the guide's q (:class:`FusedPosterior`) draws a seed from torch's generator
  (``pyro.set_rng_seed`` and restored RNG states reproduce it) and is reparameterized: the
  weights are a differentiable function of the scores given the seed;
- the model's prior (:class:`FusedPrior`) has no counter-based sampler (Gamma draws need
  rejection); without a guide it samples a full map S from the materialized prior, and the
  layer normalizes it, as on the materialized path;
- their KL, the only term ``TraceMeanField_ELBO`` reads at these sites, is the closed form from
  row statistics (:class:`bam_pyro.kl.rows.RowStatistics`): the clean log-normalizers that the
  fused attention returns and sums over the keys (prefix sums under a causal mask);
- log-densities (read by Monte Carlo ELBOs and by Pyro's validation) are those of the map that
  the seed regenerates under the materialized distributions: exact, and a full map, computed only
  when asked for.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions import constraints, register_kl

from . import noise
from .attention_map import AttentionMap
from .axes import DenseKeys
from .config import BamConfig
from .distributions import variational_distribution
from .fused import bayesian_dot_attention
from .kl import RowStatistics
from .normalize import log_normalized

#: builds the prior p(S) of a materialized map from its Phi and axis (``BayesianAttention.prior``)
PriorBuilder = Callable[[Tensor, DenseKeys], dist.TorchDistribution]


class DotProductCall:
    """One call of fused Bayesian attention: its inputs and everything derived from them.

    ``query`` ``[*draws, *batch, H, Lq, d]`` (scaled), ``key``/``value`` ``[*draws, *batch, H, Lk, d]``
    (draws: sample dims of the inputs, usually none); ``key_mask`` ``[*batch, 1 or H, 1, Lk]`` and
    ``query_mask`` ``[*batch, 1 or H, Lq, 1]`` (True = valid) or None; ``causal``: query i sees keys
    j <= i; ``batch_dims``: how many dims before the heads are the data batch (part of the site's
    event). ``prior_logits``: per-key contextual prior logits ``[*draws, *batch, H, Lk]`` (None:
    fixed prior); ``build_prior`` makes the materialized prior when a map is asked for.
    """

    def __init__(self, config: BamConfig, query: Tensor, key: Tensor, value: Tensor, *, key_mask: Optional[Tensor],
                 query_mask: Optional[Tensor], causal: bool, batch_dims: int, prior_logits: Optional[Tensor],
                 build_prior: PriorBuilder, dropout: float = 0.0) -> None:
        self.config, self.query, self.key, self.value = config, query, key, value
        self.key_mask, self.query_mask, self.causal = key_mask, query_mask, causal
        self.batch_dims, self.prior_logits, self.build_prior, self.dropout = batch_dims, prior_logits, build_prior, dropout
        self.event_dim = batch_dims + 3
        self.sample_shape = query.shape[: query.dim() - self.event_dim]
        self.map_shape = query.shape[len(self.sample_shape):-1] + key.shape[-2:-1]
        self.lse: Optional[Tensor] = None  # set by attend(): the clean log-normalizer of each row
        self.rows = RowStatistics(config, query, key, key_mask=key_mask, query_mask=query_mask, causal=causal,
                                  map_shape=self.map_shape, prior_logits=prior_logits)

    # --- attention -------------------------------------------------------------------------
    def attend(self, seeds: Tensor) -> Tensor:
        """The attention output ``[*draws, *batch, H, Lq, dv]`` of the q draw of ``seeds``."""
        draws = torch.broadcast_shapes(seeds.shape, self.sample_shape)
        lead = draws + self.map_shape[:-3]
        heads, num_queries = self.map_shape[-3:-1]
        flat = [x.expand(*lead, *x.shape[-3:]).reshape(-1, *x.shape[-3:]) for x in (self.query, self.key, self.value)]
        batch = math.prod(self.map_shape[:-3])
        row_keys = noise.row_keys(seeds.expand(draws), batch, heads)
        key_mask = None
        if self.key_mask is not None:  # [*batch, 1 or H, 1, Lk] -> [N, 1 or H, 1, Lk]
            key_mask = self.key_mask.expand(*lead, *self.key_mask.shape[-3:]).reshape(-1, *self.key_mask.shape[-3:])
        out, lse = bayesian_dot_attention(*flat, row_keys, self.config.family, k=self.config.k, sigma=self.config.sigma_q,
                                          key_mask=key_mask, causal=self.causal, dropout=self.dropout)
        self.lse = lse.reshape(*lead, heads, num_queries)
        return out.reshape(*lead, heads, num_queries, -1)

    # --- the site ----------------------------------------------------------------------------
    def num_valid(self) -> Tensor:
        """Valid entries of one map: the KL's count under the ``mean`` reduction (a 0-dim tensor on
        the inputs' device, never read on the host)."""
        return self.rows.num_valid()

    def kl(self) -> Tensor:
        """KL(q || p) summed over the valid entries of the call, per draw: shape ``sample_shape``."""
        if self.lse is None:
            raise RuntimeError("the KL of a fused attention site is read from its attention call; call attend() first")
        return self.rows.kl(self.lse).to(self.query.dtype)

    # --- materialized, on request ------------------------------------------------------------
    def axis(self) -> DenseKeys:
        """The materialized path's axis of the call (the causal mask as a full [Lq, Lk] mask)."""
        mask = self.key_mask
        if self.causal:
            num_queries, num_keys = self.map_shape[-2], self.map_shape[-1]
            causal = torch.ones(1, num_queries, num_keys, dtype=torch.bool, device=self.query.device).tril()
            mask = causal if mask is None else mask & causal
        return DenseKeys(mask, batch_shape=self.map_shape[:-3], query_mask=self.query_mask)

    def phi(self, axis: DenseKeys) -> Tensor:
        return log_normalized(axis, self.query @ self.key.transpose(-1, -2))

    def log_weights(self, seeds: Tensor, phi: Tensor) -> Tensor:
        """log S of the q draw of ``seeds``: ``Phi + log(q's noise)`` with q's constants."""
        config = self.config
        drawn = noise.noise_map(seeds, self.map_shape, config.family, config.k, config.sigma_q, phi.dtype)
        constant = math.lgamma(1.0 + 1.0 / config.k) if config.family == "weibull" else 0.5 * config.sigma_q**2
        return phi + drawn - constant

    def weights(self, seeds: Tensor) -> Tensor:
        """The normalized weights of the q draw of ``seeds``, materialized (a full map)."""
        axis = self.axis()
        log_s = self.log_weights(seeds, self.phi(axis))
        return axis.softmax(log_s)

    def maps(self) -> tuple[AttentionMap, AttentionMap, Tensor, DenseKeys]:
        """The materialized q and prior of the call (with Phi and the axis)."""
        axis = self.axis()
        phi = self.phi(axis)
        q = AttentionMap(variational_distribution(phi, self.config), axis.mask, axis.event_dim)
        p = AttentionMap(self.build_prior(phi, axis), axis.mask, axis.event_dim)
        return q, p, phi, axis


class _FusedSite(dist.TorchDistribution):
    """Shared by q and p of one fused call: a value per draw (the seed), log-densities through the
    materialized map."""

    arg_constraints: dict = {}
    support = constraints.integer_interval(0, 2**62)

    def __init__(self, call: DotProductCall, batch_shape: torch.Size = torch.Size()) -> None:
        self.call = call
        super().__init__(torch.Size(batch_shape), torch.Size(), validate_args=False)

    def expand(self, batch_shape: torch.Size, _instance=None) -> "_FusedSite":
        return type(self)(self.call, batch_shape)

    def _map_log_prob(self, value: Tensor, pick: int) -> Tensor:
        maps = self.call.maps()
        if value.is_floating_point():  # a prior draw of S itself (the model without a guide)
            return maps[pick].log_prob(value)
        log_s = self.call.log_weights(value, maps[2])
        return maps[pick].log_prob(torch.exp(log_s))


class FusedPosterior(_FusedSite):
    """q of a fused attention call: draws its noise seed; reparameterized through the seed."""

    has_rsample = True

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:
        return noise.draw_seeds(self._extended_shape(sample_shape), device=self.call.query.device)

    def sample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:
        return self.rsample(sample_shape)

    def log_prob(self, value: Tensor) -> Tensor:
        """log q of the map the seed regenerates (a full map; Monte Carlo ELBOs and validation)."""
        return self._map_log_prob(value, 0)


class FusedPrior(_FusedSite):
    """p(S) of a fused attention call: its draws are full maps (no counter-based Gamma sampler)."""

    def sample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:
        with torch.no_grad():
            prior = self.call.maps()[1]
        # the map may carry the call's sample dims already (a layer above another's draws): only the dims
        # of the site's batch that it lacks are drawn on its left
        shape = torch.broadcast_shapes(self.batch_shape, prior.batch_shape)
        return prior.sample(sample_shape + shape[: len(shape) - len(prior.batch_shape)])

    def log_prob(self, value: Tensor) -> Tensor:
        """log p of the map (given, or regenerated from the guide's seed): a full map."""
        return self._map_log_prob(value, 1)


@register_kl(FusedPosterior, FusedPrior)
def _kl_fused(q: FusedPosterior, p: FusedPrior) -> Tensor:
    if q.call is not p.call:
        raise ValueError("the KL of fused attention sites needs q and p of the same attention call")
    return q.call.kl().expand(q.batch_shape)


class FusedSiteInfo:
    """What a fused attention site hands to the guide (the counterpart of
    :class:`~bam_pyro.sites.AttentionSiteInfo`): the call, from which q and the KL come."""

    def __init__(self, call: DotProductCall) -> None:
        self.call, self.config = call, call.config

    def as_site_distribution(self, fn: dist.TorchDistribution) -> dist.TorchDistribution:
        return fn  # already one value per draw

    def posterior(self) -> FusedPosterior:
        return FusedPosterior(self.call, self.call.sample_shape)

    def num_valid(self, axis: object) -> Tensor:
        return self.call.num_valid()

    @property
    def kl_dtype(self) -> torch.dtype:
        return self.call.query.dtype


def softmax_attention(query: Tensor, key: Tensor, value: Tensor, key_mask: Optional[Tensor], causal: bool,
                      dropout: float = 0.0) -> Tensor:
    """Softmax attention by ``scaled_dot_product_attention`` (``query`` already scaled): the
    posterior-mean point prediction of Bayesian attention, and soft attention. A query without
    valid keys gets output 0, as on the materialized path (sdpa would give NaN)."""
    import torch.nn.functional as F

    if key_mask is None:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=causal, scale=1.0)
    valid = key_mask
    if causal:
        valid = valid & torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    has_keys = valid.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=valid | ~has_keys, dropout_p=dropout, scale=1.0)
    return out * has_keys
