"""The Pyro model of transductive node classification, for any PyG network that returns logits."""

from __future__ import annotations

from typing import Any, Optional

import pyro.distributions as dist
import torch
from torch import Tensor

from ..host_reads import value_checks_enabled
from ..model import BamModel
from ..tensor_memo import LastTensorsMemo


#: the graph :func:`validate_graph` last passed: the same tensors, unwritten since, are not checked again
_CHECKED: LastTensorsMemo[None] = LastTensorsMemo()


class NodeClassifier(BamModel):
    """Pyro model for transductive node classification: labels of the chosen nodes are observed.

    ``model(x, edge_index, y=None, nodes=idx)``: ``y ~ Categorical(logits[nodes])``. A graph given
    as node features and an edge index is checked first (:func:`validate_graph`, as
    :func:`~bam_pyro.host_reads.value_checks_enabled` allows, and once for tensors that come back
    unwritten: :class:`~bam_pyro.tensor_memo.LastTensorsMemo`): an edge to a node that does not
    exist is an error naming it, not an index error deep in the network.
    """

    def model(self, x: Any, edge_index: Any, *args: Any, **targets: Any) -> Any:
        dense_graph = isinstance(x, Tensor) and isinstance(edge_index, Tensor) and edge_index.layout == torch.strided
        if dense_graph and value_checks_enabled(edge_index):
            features = x if x.dim() <= 2 else x[(0,) * (x.dim() - 2)]  # sample dims (predictive_draws) repeat the features
            _CHECKED.get(lambda: validate_graph(features, edge_index), x, edge_index)
        return super().model(x, edge_index, *args, **targets)

    def likelihood(self, logits: Tensor, y: Optional[Tensor] = None, nodes: Optional[Tensor] = None) -> None:
        logits = self.align_to_plate(logits, ndim=2)
        if nodes is not None:
            logits = logits.index_select(-2, nodes)
            y = None if y is None else y.index_select(-1, nodes)
        self.observe("y", dist.Categorical(logits=logits), y)


def validate_graph(x: Tensor, edge_index: Tensor) -> None:
    """Clear errors for inputs that would otherwise fail deep inside the network, or silently."""
    if x.dim() != 2:
        raise ValueError(f"node features must have shape [num_nodes, num_features], got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).any(-1).nonzero().flatten()
        raise ValueError(f"node features contain NaN or inf at {bad.numel()} nodes (first: {bad[:5].tolist()})")
    if edge_index.dim() != 2 or edge_index.size(0) != 2 or edge_index.dtype != torch.long:
        raise ValueError(f"edge_index must be a LongTensor of shape [2, num_edges], got {edge_index.dtype} {tuple(edge_index.shape)}")
    if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= x.size(0)):
        raise ValueError(f"edge_index refers to nodes outside [0, {x.size(0)})")

