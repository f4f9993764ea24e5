"""The adjacency forms PyG's convolutions accept, read into one: an ``edge_index`` of (source,
target) rows, and the attention weights given back in the form that came in.

PyG passes a graph as an ``edge_index`` ``[2, E]``, as a ``torch.sparse`` adjacency or as a
``torch_sparse.SparseTensor``; both sparse forms are transposed (``adj_t[target, source]``), and
their shape fixes the node counts. An attention layer works on the edge list: :func:`read_adjacency`
turns any form into it, :func:`attention_like` turns per-edge attention weights back into the
caller's form (an edge list with its weights, or a sparse matrix of the same layout).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor, to_edge_index, to_torch_sparse_tensor

#: how a caller passes a graph: edge list, torch.sparse adjacency or SparseTensor
Adj = Union[Tensor, SparseTensor]


class Adjacency(NamedTuple):
    """A graph as an edge list. ``size``: (sources, targets) when the adjacency or the caller fixes
    them, else None (the node features do); ``layout``: the sparse form it came in (a
    ``torch.layout``, or ``SparseTensor``), None for an ``edge_index``."""

    edge_index: Tensor
    edge_attr: Optional[Tensor]
    size: Optional[tuple[int, int]]
    layout: Optional[Union[torch.layout, type]]


def read_adjacency(
    edge_index: Adj, edge_attr: Optional[Tensor] = None, size: Optional[tuple[int, int]] = None
) -> Adjacency:
    """The edge list of any of PyG's adjacency forms. As in PyG's message passing, the values of a
    sparse adjacency serve as edge features when none are given (torch.sparse: only
    multi-dimensional values; one value per edge is an edge weight)."""
    if isinstance(edge_index, SparseTensor):
        target, source, values = edge_index.coo()
        num_targets, num_sources = edge_index.sparse_sizes()
        edge_attr = values if edge_attr is None else edge_attr
        return Adjacency(torch.stack([source, target]), edge_attr, (num_sources, num_targets), SparseTensor)
    if is_torch_sparse_tensor(edge_index):
        (target, source), values = to_edge_index(edge_index)
        if edge_attr is None and values.dim() > 1:
            edge_attr = values
        num_targets, num_sources = edge_index.shape[:2]
        return Adjacency(torch.stack([source, target]), edge_attr, (num_sources, num_targets), edge_index.layout)
    if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.size(0) != 2:
        shape = tuple(edge_index.shape) if isinstance(edge_index, Tensor) else type(edge_index).__name__
        raise ValueError(f"edge_index must be a [2, num_edges] tensor or a sparse adjacency, got {shape}")
    return Adjacency(edge_index, edge_attr, None if size is None else tuple(size), None)


def attention_like(adjacency: Adjacency, edge_index: Tensor, weights: Tensor, size: tuple[int, int]):
    """Per-edge attention ``weights`` ``[E, heads]`` in the form PyG's attention layers give them
    back: ``(edge_index, weights)`` for an edge list, ``(adj_t, weights)`` with ``adj_t`` a
    ``[targets, sources, heads]`` sparse tensor of the input's layout for a torch.sparse adjacency,
    (``weights`` in its order of entries) and that ``SparseTensor`` alone for a
    ``SparseTensor``."""
    if adjacency.layout is None:
        return edge_index, weights
    if weights.dim() != 2:
        raise ValueError(
            f"attention weights with sample dimensions {tuple(weights.shape[:-2])} have no sparse "
            "adjacency form; pass an edge_index to get them"
        )
    transposed = edge_index.flip(0)  # rows are targets
    num_sources, num_targets = size
    if adjacency.layout is SparseTensor:
        return SparseTensor.from_edge_index(transposed, weights, sparse_sizes=(num_targets, num_sources))
    adj_t = to_torch_sparse_tensor(transposed, weights, (num_targets, num_sources), layout=adjacency.layout)
    return adj_t, adj_t.values()  # the weights in the order of the sparse tensor's entries
