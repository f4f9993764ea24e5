"""Where the keys of each query are: the one thing dense and sparse attention do differently.

An *attention axis* normalizes per-entry values over the keys of each query, spreads per-key
values onto entries, and says which entries are valid. ``BayesianAttention`` is written once
against this interface:

- :class:`DenseKeys`: entries ``[..., heads, queries, keys]`` with an optional boolean mask of
  valid keys (padding), broadcastable to the entries.
- :class:`bam_pyro.pyg.EdgeKeys`: entries ``[..., edges, heads]`` over a PyG ``edge_index``
  (row 0 = source = key, row 1 = target = query); normalization runs over each target's incoming
  edges, so memory is linear in the number of edges. It lives with the PyG integration, which
  needs ``torch_geometric``.

Any leading dimensions (posterior samples, particles, batches) broadcast through both.
"""

from __future__ import annotations

from typing import Optional, Protocol, Union

import torch
from torch import Tensor

from .host_reads import values_at_hand


class AttentionAxis(Protocol):
    #: number of trailing dimensions that make up one attention map (the Pyro event dims)
    event_dim: int
    #: boolean tensor of valid entries (broadcastable to the entries), or None if all are valid
    mask: Optional[Tensor]
    #: backward passes recompute entry-sized intermediates instead of keeping them (see
    #: :mod:`bam_pyro.normalize`): worth it where entries are many (dense maps)
    recompute: bool

    def softmax(self, values: Tensor) -> Tensor:
        """Normalize per-entry values over each query's keys."""

    def key_sum(self, values: Tensor) -> Tensor:
        """Sum per-entry values over each query's keys, broadcastable back onto the entries
        (values of masked entries must be zero: they are added in)."""

    def zero_masked_keys(self, values: Tensor) -> Tensor:
        """Per-entry values with those of masked keys set to zero."""

    def spread(self, per_key: Tensor) -> Tensor:
        """Map per-key values ``[..., keys, heads]`` onto the entries."""

    def softmax_all_keys(self, per_key: Tensor) -> Tensor:
        """Softmax of per-key values ``[..., keys, heads]`` over every valid key of the call: one
        distribution shared by all queries, still per key (masked keys get 0)."""

    def num_valid(self, entries: Tensor) -> Union[int, Tensor]:
        """Number of valid entries in one attention map of ``entries`` (no sample dims): an int
        where the shapes tell, else a 0-dim tensor on the mask's device (never read on the host)."""


class DenseKeys:
    """Keys along the last dimension of ``[*batch, heads, queries, keys]`` entries.

    ``mask`` (True = valid key) broadcasts to the entries and carries the data-batch dims; without
    a mask, pass ``batch_shape``. The batch dims are part of a site's event: one sample site per
    attention call covers the whole batch (its KL is the sum over the batch either way), so the
    network needs no data plate around it and only the likelihood declares one.

    ``query_mask`` (True = valid query, broadcasting to the entries, e.g. ``[B, 1, Lq, 1]``) leaves
    padded queries (a padded target or question) out of the site: their rows carry no KL and do not
    count in its mean. Each row is still normalized over its valid keys, so that no row is all
    masked (which would push the normalization off its fast path); the caller ignores those rows.

    A query whose keys are all masked (an empty sequence) gets all-zero weights, in the point
    prediction, in draws and at the site, and carries no KL (none of its entries is in the site),
    as PyG's softmax leaves a node without edges: its attention output is zero. PyTorch's
    ``scaled_dot_product_attention`` gives NaN there instead, which one such query spreads to the
    loss and every gradient of its batch; a uniform weight over the padding (what a large negative
    fill alone gives) would mix padding into the output silently. On CPU (eager) a look at the mask
    skips zeroing them when there are none; on an accelerator, on ``meta`` and under
    ``torch.compile`` they are zeroed unconditionally (one more pass over the weights), so that no
    call reads the mask on the host (see :mod:`bam_pyro.host_reads`).
    """

    recompute = True  # maps grow with the square of the length

    def __init__(self, mask: Optional[Tensor] = None, batch_shape: torch.Size = torch.Size(),
                 query_mask: Optional[Tensor] = None) -> None:
        for name, given in (("mask", mask), ("query_mask", query_mask)):
            if given is None:
                continue
            if given.dtype != torch.bool:
                raise TypeError(f"attention {name} must be boolean (True = valid), got {given.dtype}")
            if given.dim() < 3:
                raise ValueError(
                    f"attention {name} must broadcast to [..., heads, queries, keys] "
                    f"(at least 3 dims), got shape {tuple(given.shape)}"
                )
        if mask is not None and query_mask is not None and not broadcastable(mask.shape, query_mask.shape):
            raise ValueError(f"attention mask of shape {tuple(mask.shape)} and query_mask of shape "
                             f"{tuple(query_mask.shape)} do not broadcast together")
        #: the mask of the keys each query normalizes over
        self.key_mask = mask
        #: queries without any valid key (their weights are zero), or None if known to be none
        self.empty_rows = None
        if mask is not None:
            empty = ~mask.any(dim=-1, keepdim=True)
            self.empty_rows = None if values_at_hand(empty) and not bool(empty.any()) else empty
        #: the entries of the sample site: valid keys of valid queries
        self.mask = mask if query_mask is None else query_mask if mask is None else mask & query_mask
        if self.mask is not None:  # a mask shared by the batch ([1, 1, 1, keys]) stands for all of it
            if not broadcastable(self.mask.shape[:-3], torch.Size(batch_shape)):
                raise ValueError(f"attention mask of shape {tuple(self.mask.shape)} does not broadcast to the "
                                 f"batch {tuple(batch_shape)}")
            batch_shape = torch.broadcast_shapes(self.mask.shape[:-3], torch.Size(batch_shape))
        self.batch_shape = torch.Size(batch_shape)
        self.event_dim = 3 + len(self.batch_shape)

    def softmax(self, values: Tensor) -> Tensor:
        if self.key_mask is not None:
            values = values.masked_fill(~self.key_mask, torch.finfo(values.dtype).min)
        weights = values.softmax(dim=-1)
        return weights if self.empty_rows is None else weights.masked_fill(self.empty_rows, 0.0)

    def key_sum(self, values: Tensor) -> Tensor:
        return values.sum(dim=-1, keepdim=True)

    def zero_masked_keys(self, values: Tensor) -> Tensor:
        return values if self.key_mask is None else values.masked_fill(~self.key_mask, 0.0)

    def spread(self, per_key: Tensor) -> Tensor:
        # [..., keys, heads] -> [..., heads, 1, keys]: one value per key, shared by all queries
        return per_key.transpose(-1, -2).unsqueeze(-2)

    def softmax_all_keys(self, per_key: Tensor) -> Tensor:
        if self.key_mask is not None:  # a key is valid if any query may attend to it
            valid = self.key_mask.any(dim=-2).transpose(-1, -2)  # [..., keys, heads or 1]
            per_key = per_key.masked_fill(~valid, torch.finfo(per_key.dtype).min)
        return per_key.softmax(dim=-2)

    def num_valid(self, entries: Tensor) -> Union[int, Tensor]:
        event = entries.shape[-self.event_dim:]  # the batch as the entries have it, not as the mask
        return event.numel() if self.mask is None else self.mask.expand(event).sum()


def broadcastable(*shapes: torch.Size) -> bool:
    """Whether the shapes broadcast together."""
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return False
    return True
