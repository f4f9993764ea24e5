"""The messages of many attention draws summed at once, without a message per draw and edge.

Under ``Predictive(parallel=True)`` (and :func:`bam_pyro.predictive.predictive_draws`) the
attention weights of a graph attention layer come with leading draw dimensions, ``[*draws, E, H]``
(in eval mode the first layer's features, scores, Phi and prior have none: they are computed once
for all draws). PyG's ``propagate`` then multiplies every edge's source features by the weights
of every draw, a ``[*draws, E, H, C]`` message tensor (C times the weights), and scatters it onto
the targets: about a third of the time of 100 draws of a Cora GAT.

Here each (target, head) is a bag of its incoming edges, and ``F.embedding_bag`` sums the
weighted source features of every bag directly: the weights are gathered once into the bags'
order, and no message tensor is made. Draws go to ``embedding_bag`` in groups of about
:data:`BAG_ROWS` weighted rows, so that few calls serve many draws (each call starts the threads)
and the repeated index stays small. Sums come in another order than ``propagate``'s: the same
outputs to float rounding.

Only for draws: weights or features that need a gradient take ``propagate`` (vectorized
particles in training), as do edge features in the messages (the graph transformer's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

#: weighted rows per ``embedding_bag`` call (see module doc)
BAG_ROWS = 2**20


class InEdgeBags(NamedTuple):
    """A graph's incoming edges grouped per (target, head), in the bags' order: ``weight_order``
    indexes the flattened weights ``[E * H]``, ``rows`` the flattened source features
    ``[sources * H, C]``; ``offsets`` ``[targets * H]`` is where each bag starts."""

    weight_order: Tensor
    rows: Tensor
    offsets: Tensor


def in_edge_bags(edge_index: Tensor, num_targets: int, heads: int) -> InEdgeBags:
    """The bags of ``edge_index`` (row 0: sources, row 1: targets), one per target and head."""
    source, target = edge_index
    order = torch.argsort(target, stable=True)
    degree = torch.bincount(target, minlength=num_targets)
    start = torch.cumsum(degree, 0) - degree  # first sorted edge of each target
    owner = target.index_select(0, order)
    rank = torch.arange(order.numel(), device=order.device) - start.index_select(0, owner)  # within its target
    head = torch.arange(heads, device=order.device)
    # bag (n, h) holds n's edges k = 0 .. degree[n] - 1 at start[n] * H + h * degree[n] + k
    position = ((start.index_select(0, owner) * heads + rank).unsqueeze(1) + head * degree.index_select(0, owner).unsqueeze(1)).flatten()
    weight_order = torch.empty_like(position).index_put_((position,), (order.unsqueeze(1) * heads + head).flatten())
    rows = torch.empty_like(position).index_put_((position,), (source.index_select(0, order).unsqueeze(1) * heads + head).flatten())
    offsets = (start.unsqueeze(1) * heads + head * degree.unsqueeze(1)).flatten()
    return InEdgeBags(weight_order, rows, offsets)


def aggregates_in_bags(weights: Tensor, values: Tensor) -> bool:
    """Whether :func:`aggregate_draws` serves these weights and source features: the weights carry
    draw dimensions, neither needs a gradient, and both share a dtype on a CPU or CUDA device."""
    needs_grad = torch.is_grad_enabled() and (weights.requires_grad or values.requires_grad)
    return (weights.dim() > 2 and not needs_grad and weights.dtype == values.dtype
            and weights.device.type in ("cpu", "cuda"))


def aggregate_draws(weights: Tensor, values: Tensor, edge_index: Tensor, num_targets: int) -> Tensor:
    """``out[..., n, h] = sum over edges e into n of weights[..., e, h] * values[..., source_e, h]``.

    ``weights``: ``[*draws, E, H]``; ``values``: source features ``[*lead, sources, H, C]`` with
    ``lead`` empty or broadcasting against ``draws``; returns ``[*broadcast, num_targets, H, C]``,
    what ``propagate`` gives with messages ``values_j * weights``."""
    num_edges, heads = weights.shape[-2:]
    num_sources, channels = values.size(-3), values.size(-1)
    lead = torch.broadcast_shapes(weights.shape[:-2], values.shape[:-3])
    bags = in_edge_bags(edge_index, num_targets, heads)
    entries = num_edges * heads
    w = weights.expand(*lead, num_edges, heads).reshape(-1, entries).index_select(1, bags.weight_order)
    shared = values.shape[:-3].numel() == 1  # one table of source features for every draw
    if shared:
        table = values.reshape(num_sources * heads, channels)
    else:
        table = values.expand(*lead, *values.shape[-3:]).reshape(-1, num_sources * heads, channels)
    group = max(1, BAG_ROWS // max(1, entries))
    slot = torch.arange(group, device=w.device).unsqueeze(1)
    rows = (bags.rows + slot * (0 if shared else num_sources * heads)).flatten()
    offsets = (bags.offsets + slot * entries).flatten()
    sums = []
    for first in range(0, w.size(0), group):
        size = min(group, w.size(0) - first)
        rows_of = table if shared else table[first:first + size].reshape(-1, channels)
        sums.append(F.embedding_bag(rows[: size * entries], rows_of, offsets[: size * num_targets * heads],
                                    mode="sum", per_sample_weights=w[first:first + size].reshape(-1)))
    out = sums[0] if len(sums) == 1 else torch.cat(sums)
    return out.view(*lead, num_targets, heads, channels)
