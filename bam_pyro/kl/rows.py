"""The KL of a fused attention call from row statistics, without its attention map.

On the fused path (:mod:`bam_pyro.fused`) the map is never built, so the KL of a call,
``sum over the valid entries of KL(q(S_ij | Phi_ij) || p(S_ij))``, is taken row by row from sums over
each query's valid keys: row i has the valid keys V_i (n_i of them), scores s_ij and
``Phi_ij = s_ij - lse_i`` with ``lse_i`` = logsumexp over V_i, which the fused attention returns.
For dot-product scores ``s_ij = q_i . k_j``, so the sums over V_i of per-key values times scores are
dot products of q_i with per-key sums (prefix sums under a causal mask). :func:`weibull_gamma_row_kl`
and :func:`lognormal_row_kl` are the closed forms in those sums; :class:`RowStatistics` computes the
sums of one call (in float64).

The fused path takes Phi exactly, without the materialized path's floor ``log(p + 1e-20)``, so the
two differ only where an attention weight is below 1e-20 (by alpha * the log of the floor's share,
per such entry).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..config import BamConfig
from ..distributions import MIN_GAMMA_SHAPE
from ..fused import chunk_size_for
from ..normalize import LOG_FLOOR
from .closed_forms import weibull_gamma_constant


def weibull_gamma_row_kl(lse: Tensor, alpha_sum: Tensor, alpha_score_sum: Tensor, constant_sum: Tensor,
                         beta: float, has_keys: Tensor) -> Tensor:
    """Sum over a row of KL(Weibull(k, exp(Phi) / Gamma(1 + 1/k)) || Gamma(alpha_ij, beta)).

    With the entry-wise KL ``c(alpha) - alpha * Phi + beta * exp(Phi)``
    (:func:`~bam_pyro.kl.closed_forms.kl_mean_weibull_gamma`, ``c`` the terms of alpha alone, with
    ``lgamma(1 + 1/k)``), a row needs

        sum_j c(alpha_ij)  -  sum_j alpha_ij s_ij  +  lse_i * sum_j alpha_ij  +  beta

    (``sum_j exp(Phi_ij) = 1``): ``constant_sum`` = sum_j c(alpha_ij), ``alpha_score_sum`` = sum_j
    alpha_ij s_ij (for dot-product scores ``q_i . sum_j alpha_ij k_j``), ``alpha_sum`` = sum_j
    alpha_ij. ``has_keys``: 1 for rows with a valid key, else 0 (their terms are all zero).

    float32: ``lse_i * sum alpha`` and ``sum alpha s`` are of the size of the scores times
    ``sum alpha`` and cancel down to the KL's alpha * Phi part; with alpha ~ beta * Psi that is
    no worse than the entry-wise form. :class:`RowStatistics` sums in float64.
    """
    return constant_sum - alpha_score_sum + lse * alpha_sum + beta * has_keys


def lognormal_row_kl(lse: Tensor, count: Tensor, score_sum: Tensor, square_sum: Tensor, score_mu_sum: Tensor,
                     mu_sum: Tensor, mu_square_sum: Tensor, sigma_q: float, sigma_p: float) -> Tensor:
    """Sum over a row of KL(LogNormal(Phi - sigma_q^2/2, sigma_q) || LogNormal(mu_ij, sigma_p)).

    Entry-wise (:func:`~bam_pyro.kl.closed_forms.kl_lognormal_lognormal`): ``log(sigma_p/sigma_q) +
    sigma_q^2/(2 sigma_p^2) - 1/2 + (s_ij - mu_ij - a_i)^2 / (2 sigma_p^2)`` with
    ``a_i = lse_i + sigma_q^2/2``; the square expands into the row sums ``score_sum`` = sum_j s_ij
    (``q_i . sum_j k_j``), ``square_sum`` = sum_j s_ij^2 (``q_i^T (sum_j k_j k_j^T) q_i``),
    ``score_mu_sum`` = sum_j s_ij mu_ij, ``mu_sum``, ``mu_square_sum`` and ``count`` = n_i.

    float32: the expansion cancels terms of size n_i * a_i^2 down to the spread of Phi;
    :class:`RowStatistics` sums in float64, where at n_i = 10^5 and |a_i| ~ 30 the KL keeps about 8 digits.
    """
    shift = lse + 0.5 * sigma_q**2
    squares = (square_sum - 2 * score_mu_sum + mu_square_sum) - 2 * shift * (score_sum - mu_sum) + count * shift.square()
    constant = math.log(sigma_p) - math.log(sigma_q) + 0.5 * (sigma_q / sigma_p) ** 2 - 0.5
    return count * constant + squares * (0.5 / sigma_p**2)


class RowStatistics:
    """The row sums of one fused dot-product attention call, and its KL from them.

    ``query`` ``[*draws, *batch, H, Lq, d]`` (scaled) and ``key`` ``[*draws, *batch, H, Lk, d]``;
    ``key_mask`` ``[*batch, 1 or H, 1, Lk]`` and ``query_mask`` ``[*batch, 1 or H, Lq, 1]`` (True =
    valid) or None; ``causal``: query i sees keys j <= i; ``map_shape``: ``[*batch, H, Lq, Lk]``;
    ``prior_logits``: per-key contextual prior logits ``[*draws, *batch, H, Lk]`` (None: fixed prior).
    """

    def __init__(self, config: BamConfig, query: Tensor, key: Tensor, *, key_mask: Optional[Tensor],
                 query_mask: Optional[Tensor], causal: bool, map_shape: torch.Size, prior_logits: Optional[Tensor]) -> None:
        self.config, self.query, self.key = config, query, key
        self.key_mask, self.query_mask, self.causal = key_mask, query_mask, causal
        self.map_shape, self.prior_logits = map_shape, prior_logits

    def num_valid(self) -> Tensor:
        """Valid entries of one map: the KL's count under the ``mean`` reduction (a 0-dim tensor on
        the inputs' device, never read on the host)."""
        rows = self._row_counts() * self._row_weights()
        return rows.expand(*self.map_shape[:-1]).sum()

    def kl(self, lse: Tensor) -> Tensor:
        """KL(q || p) summed over the valid entries of the call, per draw (float64), given each
        row's clean log-normalizer ``lse`` ``[*draws, *batch, H, Lq]``."""
        if self.config.family == "weibull":
            rows = self._weibull_rows(lse.double())
        else:
            rows = self._lognormal_rows(lse.double())
        rows = rows * self._row_weights()
        return rows.sum(dim=tuple(range(-(len(self.map_shape) - 1), 0)))

    def _q(self) -> Tensor:
        return self.query.double()

    def _keys_valid(self) -> Optional[Tensor]:
        """The key mask as per-key values ``[*batch, 1 or H, Lk, 1]`` of 1 (valid) and 0."""
        return None if self.key_mask is None else self.key_mask.transpose(-1, -2).double()

    def _row_sum(self, per_key: Tensor) -> Tensor:
        """Per-key values ``[..., Lk, r]`` summed over each query's valid keys: ``[..., Lq or 1, r]``."""
        valid = self._keys_valid()
        if valid is not None:
            per_key = per_key * valid
        if not self.causal:
            return per_key.sum(dim=-2, keepdim=True)
        prefix = per_key.cumsum(dim=-2)
        num_queries, num_keys = self.map_shape[-2], self.map_shape[-1]
        index = torch.arange(num_queries, device=prefix.device).clamp_max(num_keys - 1)
        return prefix.index_select(-2, index)

    def _row_counts(self) -> Tensor:
        ones = torch.ones(self.map_shape[-1], 1, dtype=torch.float64, device=self.query.device)
        return self._row_sum(ones)[..., 0]  # [..., Lq or 1]

    def _row_weights(self) -> Tensor:
        """1 for the rows of the site (a valid query with a valid key), else 0: ``[..., Lq]``."""
        has_keys = (self._row_counts() > 0).double()
        return has_keys if self.query_mask is None else has_keys * self.query_mask[..., 0].double()

    def _dot_rows(self, per_key_vectors: Tensor) -> Tensor:
        """``q_i . sum_{j in V_i} v_j`` for per-key vectors ``[..., Lk, d]``: ``[..., Lq]``."""
        return (self._q() * self._row_sum(per_key_vectors)).sum(-1)

    def _per_key_log_psi(self) -> Tensor:
        """``log(Psi_j + 1e-20)`` ``[..., H, Lk, 1]``, Psi a softmax over the keys that some query
        sees: each query's keys without a causal mask (both scopes agree there), all of the call's
        under one (``all_keys``; a causal query i sees no key beyond i)."""
        logits = self.prior_logits.double().unsqueeze(-1)
        seen = None if self.key_mask is None else self.key_mask.transpose(-1, -2)
        if self.causal and self.map_shape[-1] > self.map_shape[-2]:
            reached = (torch.arange(self.map_shape[-1], device=logits.device) < self.map_shape[-2])[:, None]
            seen = reached if seen is None else seen & reached
        if seen is not None:
            logits = logits.masked_fill(~seen, torch.finfo(torch.float64).min)
        return torch.log(torch.softmax(logits, dim=-2) + LOG_FLOOR)

    def _per_query_prior(self) -> bool:
        """Whether the contextual prior is normalized over each query's own prefix (causal, query_keys)."""
        return self.prior_logits is not None and self.causal and self.config.prior_scope == "query_keys"

    def _prefix_log_normalizer(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per-key ``w_j = exp(l_j - m)`` ``[..., Lk, 1]``, each query's ``log sum_{j in V_i} w_j``
        ``[..., Lq, 1]`` and m (the largest logit; float64 keeps the prefix sums from underflowing):
        ``Psi_ij = w_j / sum_{V_i} w``, ``log Z_i = log sum_{V_i} w + m``."""
        logits = self.prior_logits.double().unsqueeze(-1)
        top = logits.amax(dim=-2, keepdim=True).detach()
        weights = torch.exp(logits - top)
        return weights, torch.log(self._row_sum(weights).clamp_min(torch.finfo(torch.float64).tiny)), top

    def _weibull_rows(self, lse: Tensor) -> Tensor:
        config = self.config
        keys = self.key.double()
        k = keys.new_tensor(config.k)
        beta = keys.new_tensor(config.beta)
        log_mean_factor = math.lgamma(1.0 + 1.0 / config.k)
        has_keys = (self._row_counts() > 0).double()
        if self._per_query_prior():
            weights, log_sum, _ = self._prefix_log_normalizer()
            scale = config.beta if config.gamma_shape == "psi_beta" else 1.0
            alpha_sum = scale * has_keys
            alpha_score_sum = scale * self._dot_rows(weights * keys) / torch.exp(log_sum[..., 0])
            constant_sum = self._prefix_constant_sums(weights.squeeze(-1), log_sum, k, beta, log_mean_factor)
        else:
            if self.prior_logits is None:
                alpha = keys.new_tensor(max(config.alpha, MIN_GAMMA_SHAPE)).expand(*keys.shape[:-1], 1)
            else:
                log_alpha = self._per_key_log_psi() + (math.log(config.beta) if config.gamma_shape == "psi_beta" else 0.0)
                alpha = log_alpha.clamp_min(math.log(MIN_GAMMA_SHAPE)).exp()
            alpha_sum = self._row_sum(alpha)[..., 0]
            alpha_score_sum = self._dot_rows(alpha * keys)
            constant_sum = self._row_sum(weibull_gamma_constant(k, alpha, beta, log_mean_factor))[..., 0]
        return weibull_gamma_row_kl(lse, alpha_sum, alpha_score_sum, constant_sum, config.beta, has_keys)

    def _prefix_constant_sums(self, weights: Tensor, log_sum: Tensor, k: Tensor, beta: Tensor, log_mean_factor: float) -> Tensor:
        """sum_{j in V_i} c(alpha_ij) with ``alpha_ij = beta * e^{l_j} / Z_i`` (or without beta): lgamma
        keeps it from splitting into per-key sums, so it runs over chunks of queries, each
        recomputed in the backward pass (memory linear in the length)."""
        config = self.config
        log_beta = math.log(config.beta) if config.gamma_shape == "psi_beta" else 0.0
        num_queries, num_keys = self.map_shape[-2], self.map_shape[-1]
        chunk = chunk_size_for(weights.shape[:-1].numel(), num_keys)
        key_index = torch.arange(num_keys, device=weights.device)

        def rows(w: Tensor, ls: Tensor, start: int, stop: int) -> Tensor:
            log_psi = torch.log(w.unsqueeze(-2) * torch.exp(-ls[..., start:stop, :]) + LOG_FLOOR)
            alpha = (log_psi + log_beta).clamp_min(math.log(MIN_GAMMA_SHAPE)).exp()
            terms = weibull_gamma_constant(k, alpha, beta, log_mean_factor)
            valid = key_index <= torch.arange(start, stop, device=w.device)[:, None]
            if self.key_mask is not None:
                valid = valid & self.key_mask
            return terms.masked_fill(~valid, 0.0).sum(-1)

        parts = [checkpoint(rows, weights, log_sum, start, min(start + chunk, num_queries), use_reentrant=False)
                 for start in range(0, num_queries, chunk)]
        return torch.cat(parts, dim=-1)

    def _lognormal_rows(self, lse: Tensor) -> Tensor:
        config = self.config
        keys = self.key.double()
        counts = self._row_counts()
        score_sum = self._dot_rows(keys)
        square_sum = self._square_sums()
        if self.prior_logits is None or self._per_query_prior():
            if self.prior_logits is None:
                mu = keys.new_full((*keys.shape[:-1], 1), config.mu_p)
                log_z = None
            else:
                _, log_sum, top = self._prefix_log_normalizer()
                log_z = log_sum + top
                mu = self.prior_logits.double().unsqueeze(-1)
            score_mu_sum = self._dot_rows(mu * keys)
            mu_sum = self._row_sum(mu)[..., 0]
            mu_square_sum = self._row_sum(mu.square())[..., 0]
            if log_z is not None:  # mu_ij = l_j - log Z_i
                lz = log_z[..., 0]
                score_mu_sum = score_mu_sum - lz * score_sum
                mu_square_sum = mu_square_sum - 2 * lz * mu_sum + counts * lz.square()
                mu_sum = mu_sum - counts * lz
        else:
            mu = self._per_key_log_psi()
            score_mu_sum = self._dot_rows(mu * keys)
            mu_sum = self._row_sum(mu)[..., 0]
            mu_square_sum = self._row_sum(mu.square())[..., 0]
        return lognormal_row_kl(lse, counts, score_sum, square_sum, score_mu_sum, mu_sum, mu_square_sum,
                                config.sigma_q, config.sigma_p)

    def _square_sums(self) -> Tensor:
        """sum_{j in V_i} s_ij^2: ``q_i^T (sum_j k_j k_j^T) q_i`` without a causal mask; with one, over
        chunks of queries recomputed in the backward pass (a prefix of d x d matrices per key would
        cost L * d^2 memory)."""
        q, keys = self._q(), self.key.double()
        if not self.causal:
            valid = self._keys_valid()
            weighted = keys if valid is None else keys * valid
            gram = weighted.transpose(-1, -2) @ keys
            return ((q @ gram) * q).sum(-1)
        num_queries, num_keys = self.map_shape[-2], self.map_shape[-1]
        chunk = chunk_size_for(q.shape[:-2].numel(), num_keys)
        key_index = torch.arange(num_keys, device=q.device)

        def rows(qc: Tensor, kk: Tensor, start: int) -> Tensor:
            scores = qc.float() @ kk.float().transpose(-1, -2)
            valid = key_index <= torch.arange(start, start + qc.shape[-2], device=qc.device)[:, None]
            if self.key_mask is not None:
                valid = valid & self.key_mask
            return scores.square().masked_fill(~valid, 0.0).sum(-1).double()

        parts = [checkpoint(rows, q[..., start:start + chunk, :], keys, start, use_reentrant=False)
                 for start in range(0, num_queries, chunk)]
        return torch.cat(parts, dim=-1)
