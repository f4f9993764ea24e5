"""Alignment score functions ``f(Q, K)`` for dense attention.

Each maps per-head queries ``[..., heads, queries, d]`` and keys ``[..., heads, keys, d]`` to
scores ``[..., heads, queries, keys]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .prior import glorot_per_head_


class DotScore(nn.Module):
    """``q . k``"""

    def forward(self, query: Tensor, key: Tensor) -> Tensor:
        return query @ key.transpose(-1, -2)


class ScaledDotScore(nn.Module):
    """``q . k / sqrt(d)`` (Vaswani et al.)"""

    def forward(self, query: Tensor, key: Tensor) -> Tensor:
        return query @ key.transpose(-1, -2) / math.sqrt(query.size(-1))


class BilinearScore(nn.Module):
    """``q^T A_h k`` with one learned matrix per head (Luong's "general")."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, head_dim))
        glorot_per_head_(self.weight)

    def forward(self, query: Tensor, key: Tensor) -> Tensor:
        return (query @ self.weight) @ key.transpose(-1, -2)


class AdditiveScore(nn.Module):
    """``v_h^T tanh(W_q q + W_k k)`` (Bahdanau). Memory grows as queries x keys x hidden."""

    def __init__(self, num_heads: int, head_dim: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or head_dim
        self.query_proj = nn.Parameter(torch.empty(num_heads, head_dim, hidden))
        self.key_proj = nn.Parameter(torch.empty(num_heads, head_dim, hidden))
        self.v = nn.Parameter(torch.empty(num_heads, hidden))
        glorot_per_head_(self.query_proj)
        glorot_per_head_(self.key_proj)
        nn.init.uniform_(self.v, -1 / math.sqrt(hidden), 1 / math.sqrt(hidden))

    def forward(self, query: Tensor, key: Tensor) -> Tensor:
        q = query @ self.query_proj  # [..., H, Lq, hidden]
        k = key @ self.key_proj  # [..., H, Lk, hidden]
        hidden = torch.tanh(q.unsqueeze(-2) + k.unsqueeze(-3))  # [..., H, Lq, Lk, hidden]
        return (hidden * self.v[:, None, None, :]).sum(-1)


SCORES = {"dot": DotScore, "scaled_dot": ScaledDotScore, "bilinear": BilinearScore, "additive": AdditiveScore}


def make_score(name: str, num_heads: int, head_dim: int) -> nn.Module:
    if name not in SCORES:
        raise ValueError(f"unknown attention score {name!r}; expected one of {sorted(SCORES)}")
    if name in ("bilinear", "additive"):
        return SCORES[name](num_heads, head_dim)
    return SCORES[name]()
