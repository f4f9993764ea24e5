"""Dense multi-head Bayesian attention over ``[batch, length, features]`` inputs."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from .attention import BayesianAttention
from .axes import DenseKeys, broadcastable
from .config import BamConfig
from .scoring import make_score
from .validation import whole_number

#: the factor that turns ``q . k`` into each score function that is a dot product (the fused path's)
DOT_SCALES = {"dot": lambda head_dim: 1.0, "scaled_dot": lambda head_dim: head_dim**-0.5}


class MultiHeadBayesianAttention(nn.Module):
    """Multi-head attention whose weights are Bayesian attention (self or cross attention).

    ``query``: ``[..., Lq, d_model]``; ``key``/``value``: ``[..., Lk, d_model]``;
    ``valid_keys``: boolean ``[batch, Lk]`` (or ``[Lk]`` for every sequence), True for a key that
    may be attended; ``valid_queries``: ``[batch, Lq]`` (or ``[Lq]``), True for a valid query
    (padded queries' rows carry no KL, see :class:`~bam_pyro.axes.DenseKeys`; their outputs are
    the caller's to ignore). A mask may not add batch dims: ``[batch, 1, Lk]`` is refused rather
    than broadcast. Returns ``[..., Lq, d_model]`` and the attention weights ``[..., heads, Lq, Lk]``.

    The masks are named for what True means. ``key_padding_mask`` and ``query_padding_mask``, their
    earlier names, still work with that meaning, with a ``FutureWarning`` (once): True marks a valid
    key here, while ``torch.nn.MultiheadAttention``'s ``key_padding_mask`` marks padding with True.

    ``need_weights=False`` returns None for the weights and, with dot-product scores, takes the
    fused path (:meth:`BayesianAttention.attend`, no attention map in memory) unless it is
    switched off (:func:`bam_pyro.attention.set_fused`); asking for the weights materializes them, as
    PyTorch's ``nn.MultiheadAttention`` does.

    ``batch_dims``: the number of data-batch dims before the length (1: ``[batch, length,
    features]``). They join the attention site's event (a mask carries them itself); dims before
    them are sample dims (Predictive's draws, vectorized particles, which a stacked layer gets
    from the samples of the one below) and must stay out of it.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        config: BamConfig,
        score: str = "scaled_dot",
        dropout: float = 0.0,
        batch_dims: int = 1,
    ) -> None:
        super().__init__()
        whole_number("d_model", d_model)
        whole_number("num_heads", num_heads)
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.batch_dims = batch_dims
        self.query_proj = nn.Linear(d_model, d_model)
        self.key_proj = nn.Linear(d_model, d_model)
        self.value_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.score = make_score(score, num_heads, self.head_dim)
        self.score_scale = DOT_SCALES.get(score, lambda d: None)(self.head_dim)
        self.attention = BayesianAttention(config, num_heads, self.head_dim)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, x: Tensor) -> Tensor:  # [..., L, d_model] -> [..., H, L, d]
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-2, -3)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, valid_keys: Optional[Tensor] = None,
        valid_queries: Optional[Tensor] = None, need_weights: bool = True, *,
        key_padding_mask: Optional[Tensor] = None, query_padding_mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, Optional[Tensor]]:
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in length")
        valid_keys = _renamed("valid_keys", valid_keys, "key_padding_mask", key_padding_mask)
        valid_queries = _renamed("valid_queries", valid_queries, "query_padding_mask", query_padding_mask)
        q, k, v = self._heads(self.query_proj(query)), self._heads(self.key_proj(key)), self._heads(self.value_proj(value))
        mask = query_mask = None
        if valid_keys is not None:
            self._check_mask("valid_keys", valid_keys, "key", key)
            mask = valid_keys[..., None, None, :]
        if valid_queries is not None:
            self._check_mask("valid_queries", valid_queries, "query", query)
            query_mask = valid_queries[..., None, :, None]
        batch_shape = key.shape[max(key.dim() - 2 - self.batch_dims, 0) : -2]
        if not need_weights and self.score_scale is not None and self.attention.uses_fused_path():
            dropout = self.dropout.p if self.training else 0.0
            out = self.attention.attend(q * self.score_scale, k, v, keys=k.transpose(-2, -3), key_mask=mask,
                                        query_mask=query_mask, batch_dims=len(batch_shape), dropout=dropout)
            return self.out_proj(out.transpose(-2, -3).flatten(-2)), None
        axis = DenseKeys(mask, batch_shape=batch_shape, query_mask=query_mask)
        weights = self.attention(self.score(q, k), k.transpose(-2, -3), axis)
        out = self.dropout(weights) @ v  # [..., H, Lq, d]
        return self.out_proj(out.transpose(-2, -3).flatten(-2)), weights if need_weights else None


    def _check_mask(self, argument: str, mask: Tensor, role: str, inputs: Tensor) -> None:
        """A ``[..., L]`` mask fits its ``[..., L, d_model]`` inputs: as long, and of a batch that
        broadcasts to theirs without growing it (``ValueError`` naming the mask and the shape expected)."""
        batch = inputs.shape[:-2]
        fits = mask.shape[-1] == inputs.shape[-2] and broadcastable(mask.shape[:-1], batch)
        if not fits or torch.broadcast_shapes(mask.shape[:-1], batch) != batch:
            data_batch = list(batch[max(len(batch) - self.batch_dims, 0):])
            length = inputs.shape[-2]
            raise ValueError(f"{argument} of shape {tuple(mask.shape)} does not fit {role} of shape {tuple(inputs.shape)}: "
                             f"expected {data_batch + [length]} or [{length}] (True = valid {role})")


#: deprecated argument names already warned about (each warns once per process)
_warned: set[str] = set()


def _renamed(name: str, value: Optional[Tensor], old_name: str, old_value: Optional[Tensor]) -> Optional[Tensor]:
    """``value``, or the mask passed under its deprecated name ``old_name`` (same meaning: True =
    valid), with a ``FutureWarning`` the first time."""
    if old_value is None:
        return value
    if value is not None:
        raise TypeError(f"got both {name} and {old_name} (its deprecated name); pass {name} only")
    if old_name not in _warned:
        _warned.add(old_name)
        warnings.warn(
            f"{old_name} (True = valid) is deprecated: its meaning is the opposite of torch.nn.MultiheadAttention's "
            f"key_padding_mask (True = padding); pass the same mask as {name}=", FutureWarning, stacklevel=5)  # _renamed, forward, two Module call frames, the caller
    return old_value
