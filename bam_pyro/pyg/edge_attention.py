"""The forward pass that PyG's attention convolutions share, with Bayesian attention weights.

GAT, GATv2 and the graph transformer differ in how they project nodes and score an edge. The rest
is one pipeline: read the adjacency in any of PyG's forms, replace self-loops, normalize the scores
over each target's incoming edges (here :class:`bam_pyro.BayesianAttention` over
:class:`bam_pyro.pyg.EdgeKeys`, memory linear in the edges), drop the weights, sum the weighted
messages, concatenate or average the heads, give the weights back in the caller's form.
:class:`EdgeAttentionConv` runs it; a layer declares its parameters and writes :meth:`project`,
:meth:`score` and :meth:`combine`.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Union

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import add_self_loops, remove_self_loops

from ..attention import BayesianAttention
from ..config import BamConfig
from .adjacency import Adj, attention_like, read_adjacency
from .draw_aggregation import aggregate_draws, aggregates_in_bags
from .edge_keys import EdgeKeys

#: the default attention: deterministic softmax, i.e. PyG's layer itself
SOFT = BamConfig("soft")

NodeInput = Union[Tensor, tuple[Tensor, Optional[Tensor]]]


class NodeFeatures(NamedTuple):
    """Per-head node features ``[..., nodes, heads, channels]``: the sources' ``keys`` (scored, and
    read by the contextual prior) and ``values`` (the messages), the targets' ``queries`` (None
    when the targets come without features)."""

    keys: Tensor
    values: Tensor
    queries: Optional[Tensor]


class EdgeAttentionConv(MessagePassing):
    """Base class of the Bayesian graph attention layers (see the module doc).

    A subclass sets ``lin_edge`` (a projection of edge features to ``heads * out_channels``, or
    None), ``add_self_loops`` and ``fill_value``, and implements :meth:`project`, :meth:`score`
    and :meth:`combine`; its ``forward`` has its PyG counterpart's signature and calls
    :meth:`attend`. Leading sample dimensions of the node features broadcast through; attention
    draws (weights with draw dimensions) are summed without a message tensor (``bag_draws``).
    """

    #: the edge features also enter the messages (graph transformer), not only the scores
    edge_features_in_messages = False
    #: attention draws (weights with draw dimensions, no gradient) are summed per target without
    #: PyG's message tensor (:mod:`bam_pyro.pyg.draw_aggregation`); :func:`set_bag_draws` switches
    bag_draws = True

    def __init__(
        self, in_channels, out_channels: int, heads: int, concat: bool, dropout: float, config: BamConfig
    ) -> None:
        super().__init__(aggr="add", node_dim=-3)
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.concat, self.dropout = concat, dropout
        self.lin_edge: Optional[nn.Module] = None
        self.attention = BayesianAttention(config, heads, out_channels)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.attention.prior_net is not None:
            self.attention.prior_net.reset_parameters()

    def attend(
        self,
        x: NodeInput,
        edge_index: Adj,
        edge_attr: Optional[Tensor],
        size: Optional[tuple[int, int]],
        return_attention_weights: Optional[bool],
    ):
        """The layer's output for node features ``x`` (or a (sources, targets) pair), and on
        request the attention weights that weighted the messages (after dropout)."""
        if edge_attr is not None and self.lin_edge is None:
            warnings.warn("edge_attr is ignored: the layer has no edge_dim (as in PyG's)", stacklevel=3)
        nodes = self.project(x)
        adjacency = read_adjacency(edge_index, edge_attr, size)
        edge_index, edge_attr, num_src, num_dst = self.edges(adjacency, nodes)
        edge_features = self.embed_edges(edge_attr)
        scores = self.score(nodes, edge_index, edge_features)  # [..., E, H]
        attention = self.attention(scores, nodes.keys, EdgeKeys(edge_index, num_dst))
        weights = F.dropout(attention, p=self.dropout, training=self.training)
        values = self.message_values(nodes.values)
        edge_values = edge_features if self.edge_features_in_messages else None
        if self.bag_draws and edge_values is None and aggregates_in_bags(weights, values):
            out = aggregate_draws(weights, values, edge_index, num_dst)
        else:
            out = self.propagate(edge_index, x=(values, None), weights=weights, edge_values=edge_values,
                                 size=(num_src, num_dst))
        out = self.combine(out.flatten(-2) if self.concat else out.mean(-2), x if isinstance(x, Tensor) else x[1])
        if return_attention_weights:
            return out, attention_like(adjacency, edge_index, weights, (num_src, num_dst))
        return out

    def edges(self, adjacency, nodes: NodeFeatures) -> tuple[Tensor, Optional[Tensor], int, int]:
        """The edge list with its features, self-loops replaced if the layer adds them, and the
        numbers of sources and targets."""
        num_src = nodes.keys.size(-3)
        num_dst = nodes.queries.size(-3) if nodes.queries is not None else num_src  # as PyG, when nothing says
        edge_index, edge_attr = adjacency.edge_index, adjacency.edge_attr
        if self.add_self_loops:
            if adjacency.layout is SparseTensor and self.lin_edge is not None:
                raise NotImplementedError(
                    "self-loops with edge features are not supported for a SparseTensor adjacency (as in PyG)"
                )
            # one loop per node that is both a source and a target
            num_loops = min(adjacency.size) if adjacency.size is not None else min(num_src, num_dst)
            edge_index, edge_attr = remove_self_loops(edge_index, edge_attr)
            edge_index, edge_attr = add_self_loops(edge_index, edge_attr, self.fill_value, num_nodes=num_loops)
        if adjacency.size is not None:
            num_dst = adjacency.size[1]
        return edge_index, edge_attr, num_src, num_dst

    def embed_edges(self, edge_attr: Optional[Tensor]) -> Optional[Tensor]:
        """Edge features projected per head, ``[num_edges, heads, out_channels]`` (None without)."""
        if self.lin_edge is None or edge_attr is None or edge_attr.size(0) == 0:
            return None
        embedded = self.lin_edge(edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr)
        return embedded.unflatten(-1, (self.heads, self.out_channels))

    def project(self, x: NodeInput) -> NodeFeatures:
        """Node features -> per-head keys, values and queries."""
        raise NotImplementedError

    def score(self, nodes: NodeFeatures, edge_index: Tensor, edge_features: Optional[Tensor]) -> Tensor:
        """Attention scores per edge and head, ``[..., num_edges, heads]``."""
        raise NotImplementedError

    def message_values(self, values: Tensor) -> Tensor:
        """The sources' values as they enter the messages, after the attention is drawn."""
        return values

    def combine(self, out: Tensor, x_dst: Optional[Tensor]) -> Tensor:
        """The aggregated messages with the targets' own features and the bias."""
        raise NotImplementedError

    def message(self, x_j: Tensor, weights: Tensor, edge_values: Optional[Tensor]) -> Tensor:
        if edge_values is not None:
            x_j = x_j + edge_values
        return x_j * weights.unsqueeze(-1)

    def __repr__(self) -> str:
        variant = self.attention.config.variant
        extra = "" if variant == "soft" else f", variant={variant!r}"
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads}{extra})"


def set_bag_draws(model: nn.Module, enabled: bool) -> nn.Module:
    """Sum attention draws in bags (:mod:`bam_pyro.pyg.draw_aggregation`) or with PyG's
    ``propagate`` in every graph attention layer of ``model``; returns the model. Both give the
    same outputs to float rounding: the switch is there to compare them."""
    for module in model.modules():
        if isinstance(module, EdgeAttentionConv):
            module.bag_draws = bool(enabled)
    return model
