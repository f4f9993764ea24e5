"""The two distributions of the latent-alignment models (Deng et al. 2018) that Pyro does not ship.

:class:`TokensGivenAlignment`, ``p(y_j | x, y_<j, z_j = i) = softmax(generate(h_j, x_i))``: the next
token given a hard alignment. Its ``log_prob`` accepts any batch of alignments, in particular the
whole enumerated support ``[S, 1, 1]`` that ``TraceEnum_ELBO`` passes, and then scores the
*observed* token under every source position without holding the full ``[S, B, T, V]`` logits:
positions are processed in chunks of at most ``max_elements`` logits, each under activation
checkpointing when there is more than one chunk (the chunk's output layer runs again in the
backward pass), so the peak memory is one chunk whatever the source length.

:class:`MaskedDirichlet`: a Dirichlet over the valid (unpadded) entries of its last dimension; the
padded entries of a draw are exactly 0. Its KL to another one over the same entries is analytic
(registered with torch, so ``TraceMeanField_ELBO`` takes it).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from torch import Tensor
from torch.distributions import kl as torch_kl
from torch.utils.checkpoint import checkpoint

from ..host_reads import value_checks_enabled

#: concentrations of a Dirichlet alignment: ``exp(score)`` floored at 1e-2 as the reference code's
#: ``exp`` transformation, and capped so that large scores stay finite in float32
MIN_CONCENTRATION = 1e-2
MAX_CONCENTRATION = 1e4


def dirichlet_concentration(scores: Tensor) -> Tensor:
    """Dirichlet concentrations from attention scores: ``exp(score)``, clamped to
    [:data:`MIN_CONCENTRATION`, :data:`MAX_CONCENTRATION`]."""
    return scores.clamp(max=math.log(MAX_CONCENTRATION)).exp().clamp(min=MIN_CONCENTRATION)


def aligned_contexts(memory: Tensor, alignment: Tensor) -> Tensor:
    """The encoder state each alignment points at: ``memory [B, S, E]``, ``alignment [*, B|1, T|1]``
    (source indices) -> ``[*, B, T|1, E]``. A target dim of 1 stays 1: the enumerated support
    ``[S, 1, 1]`` gives ``[S, B, 1, E]``, which the output layer broadcasts over the targets."""
    if alignment.dim() < 2:
        raise ValueError(f"an alignment needs (sentence, position) dims, got shape {tuple(alignment.shape)}")
    batch = memory.size(0)
    rows = torch.arange(batch, device=memory.device).unsqueeze(-1)
    return memory[rows, alignment.expand(*alignment.shape[:-2], batch, alignment.size(-1))]


class TokensGivenAlignment(dist.TorchDistribution):
    """The next target token given a hard alignment (see module doc).

    generate: the network's output layer, ``(states [B, T, D], contexts [*, B, T|1, E]) -> logits``.
    states: decoder states ``[B, T, D]``; memory: encoder states ``[B, S, E]``;
    alignment: source indices ``[*, B|1, T|1]``; vocab_size: V;
    max_elements: most logits computed at once by ``log_prob``.
    """

    arg_constraints: dict = {}

    def __init__(self, generate: Callable[[Tensor, Tensor], Tensor], states: Tensor, memory: Tensor,
                 alignment: Tensor, vocab_size: int, max_elements: int, validate_args: Optional[bool] = None) -> None:
        self.generate, self.states, self.memory, self.alignment = generate, states, memory, alignment
        self.vocab_size, self.max_elements = vocab_size, max_elements
        batch_shape = torch.broadcast_shapes(alignment.shape, states.shape[:-1])
        super().__init__(batch_shape, validate_args=validate_args)

    @constraints.dependent_property(is_discrete=True, event_dim=0)
    def support(self) -> constraints.Constraint:
        return constraints.integer_interval(0, self.vocab_size - 1)

    def expand(self, batch_shape, _instance=None) -> "TokensGivenAlignment":
        return TokensGivenAlignment(self.generate, self.states, self.memory, self.alignment.expand(batch_shape),
                                    self.vocab_size, self.max_elements, validate_args=False)

    def logits(self) -> Tensor:
        """All logits ``[*batch_shape, V]`` (for sampling; ``log_prob`` never builds them)."""
        return self.generate(self.states, aligned_contexts(self.memory, self.alignment)).expand(*self.batch_shape, -1)

    def sample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:
        with torch.no_grad():
            return dist.Categorical(logits=self.logits()).sample(sample_shape)

    def log_prob(self, value: Tensor) -> Tensor:
        if self._validate_args:
            self._validate_sample(value)
        contexts = aligned_contexts(self.memory, self.alignment)
        lead, (batch, length) = contexts.shape[:-3], self.states.shape[:-1]
        contexts = contexts.reshape(-1, *contexts.shape[-3:])  # [L, B, T|1, E]
        tokens = value.expand(*lead, batch, length).reshape(-1, batch, length, 1)
        rows = max(1, self.max_elements // (batch * length * self.vocab_size))
        chunks = list(zip(contexts.split(rows), tokens.split(rows)))
        recompute = torch.is_grad_enabled() and len(chunks) > 1
        parts = [checkpoint(self._observed_log_prob, c, t, use_reentrant=False) if recompute
                 else self._observed_log_prob(c, t) for c, t in chunks]
        return torch.cat(parts).reshape(*lead, batch, length)

    def _observed_log_prob(self, contexts: Tensor, tokens: Tensor) -> Tensor:
        return self.generate(self.states, contexts).log_softmax(-1).gather(-1, tokens).squeeze(-1)


class MaskedDirichlet(dist.TorchDistribution):
    """Dirichlet over the entries of the last dim where ``mask`` is True (see module doc).

    A draw is a full Dirichlet draw (padded concentrations set to 1) renormalized over the valid
    entries, which is exactly a Dirichlet draw over those entries (the Gamma construction), with
    its reparameterized gradient."""

    arg_constraints = {"concentration": constraints.independent(constraints.positive, 1)}
    support = constraints.simplex
    has_rsample = True

    def __init__(self, concentration: Tensor, mask: Tensor, validate_args: Optional[bool] = None) -> None:
        if concentration.dim() < 1:
            raise ValueError("concentration must have at least one dimension")
        self.mask = mask.expand(concentration.shape)
        if value_checks_enabled(self.mask) and not bool(self.mask.any(-1).all()):
            raise ValueError("MaskedDirichlet: every row needs at least one valid entry")
        self.concentration = torch.where(self.mask, concentration, torch.ones_like(concentration))
        super().__init__(concentration.shape[:-1], concentration.shape[-1:], validate_args=validate_args)

    def expand(self, batch_shape, _instance=None) -> "MaskedDirichlet":
        shape = torch.Size(batch_shape) + self.event_shape
        return MaskedDirichlet(self.concentration.expand(shape), self.mask.expand(shape), validate_args=False)

    @property
    def mean(self) -> Tensor:
        kept = self.concentration * self.mask
        return kept / kept.sum(-1, keepdim=True)

    def rsample(self, sample_shape: torch.Size = torch.Size()) -> Tensor:
        draw = torch.distributions.Dirichlet(self.concentration).rsample(sample_shape)
        kept = draw * self.mask
        return kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)

    def log_prob(self, value: Tensor) -> Tensor:
        if self._validate_args:
            self._validate_sample(value)
        alpha, mask = self.concentration, self.mask
        log_norm = torch.lgamma((alpha * mask).sum(-1)) - torch.where(mask, torch.lgamma(alpha), 0.0).sum(-1)
        log_value = torch.where(mask, value, torch.ones_like(value)).log()
        return log_norm + torch.where(mask, (alpha - 1) * log_value, 0.0).sum(-1)


@torch_kl.register_kl(MaskedDirichlet, MaskedDirichlet)
def _kl_masked_dirichlet(q: MaskedDirichlet, p: MaskedDirichlet) -> Tensor:
    """KL(Dir(a) || Dir(b)) over the shared valid entries:
    ``lgamma(a0) - lgamma(b0) - sum_i [lgamma(a_i) - lgamma(b_i)] + sum_i (a_i - b_i)(digamma(a_i) - digamma(a0))``."""
    if q.mask.shape != p.mask.shape or not torch.equal(q.mask, p.mask):
        raise ValueError("the KL of two MaskedDirichlet needs the same mask on both")
    mask, a, b = q.mask, q.concentration, p.concentration
    a0, b0 = (a * mask).sum(-1), (b * mask).sum(-1)
    per_entry = -(torch.lgamma(a) - torch.lgamma(b)) + (a - b) * (torch.digamma(a) - torch.digamma(a0).unsqueeze(-1))
    return torch.lgamma(a0) - torch.lgamma(b0) + torch.where(mask, per_entry, 0.0).sum(-1)
