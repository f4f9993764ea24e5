"""The contextual (key-dependent) prior network: one score per key and head, ``F2(relu(F1(K)))``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def glorot_per_head_(weight: Tensor) -> Tensor:
    """Glorot-uniform init, in place, of per-head weights ``[heads, fan_in, fan_out]`` (or
    ``[heads, fan_in]``, fan_out 1): each head's matrix gets its own fans, where torch's
    ``xavier_uniform_`` would read the stack as a convolution kernel and shrink the bound."""
    fan_in, fan_out = weight.shape[1], weight.shape[2] if weight.dim() > 2 else 1
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return nn.init.uniform_(weight, -bound, bound)


class ContextualPrior(nn.Module):
    """Per-head two-layer network from a key vector to a prior logit.

    ``keys``: ``[..., keys, heads, key_dim]`` -> logits ``[..., keys, heads]``. A softmax over each
    query's keys (done by the attention axis) turns the logits into the prior mean ``Psi``; the
    output layer therefore needs no bias (a shift cancels in the softmax).
    """

    def __init__(self, num_heads: int, key_dim: int, d_mid: int) -> None:
        super().__init__()
        self.hidden_weight = nn.Parameter(torch.empty(num_heads, key_dim, d_mid))
        self.hidden_bias = nn.Parameter(torch.empty(num_heads, d_mid))
        self.out_weight = nn.Parameter(torch.empty(num_heads, d_mid))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        glorot_per_head_(self.hidden_weight)
        nn.init.zeros_(self.hidden_bias)
        glorot_per_head_(self.out_weight)

    def forward(self, keys: Tensor) -> Tensor:
        if keys.dim() < 2 or keys.shape[-2:] != self.hidden_weight.shape[:2]:
            raise ValueError(
                "contextual prior expects keys of shape [..., keys, heads, key_dim] with "
                f"(heads, key_dim) = {tuple(self.hidden_weight.shape[:2])}, got {tuple(keys.shape)}"
            )
        hidden = torch.einsum("...hd,hdm->...hm", keys, self.hidden_weight) + self.hidden_bias
        return torch.einsum("...hm,hm->...h", torch.relu(hidden), self.out_weight)
