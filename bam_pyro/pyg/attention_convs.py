"""PyG's other attention convolutions with Bayesian attention weights, on the shared core of
:mod:`bam_pyro.pyg.edge_attention`: each is its PyG layer's parameters, projection and scoring function.

- :class:`BayesianGATv2Conv` (Brody et al. 2022), PyG's ``GATv2Conv``:
  ``a . LeakyReLU(W_s h_j + W_t h_i [+ W_e e_ji])``, the nonlinearity before the attention vector;
- :class:`BayesianTransformerConv` (Shi et al. 2021), PyG's ``TransformerConv``:
  ``q_i . (k_j [+ W_e e_ji]) / sqrt(C)``, messages ``v_j [+ W_e e_ji]``, a skip connection
  optionally gated by ``beta``.

Same arguments in the same order and the same parameters as PyG's layers, then the keyword
``config`` (default: soft attention, i.e. PyG's layer). As for :class:`bam_pyro.pyg.BayesianGATConv`,
the attention weights given back are those that weighted the messages (after dropout; PyG's
``TransformerConv`` gives them before).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.nn.inits import glorot, zeros

from ..config import BamConfig

from .adjacency import Adj
from .edge_attention import SOFT, EdgeAttentionConv, NodeFeatures, NodeInput


def heads_of(lin: nn.Module, x: Tensor, heads: int) -> Tensor:
    """``lin(x)`` split into heads: ``[..., nodes, heads, channels]``."""
    return lin(x).unflatten(-1, (heads, -1))


class BayesianGATv2Conv(EdgeAttentionConv):
    """PyG's ``GATv2Conv`` with Bayesian attention weights (see the module doc)."""

    def __init__(
        self,
        in_channels: Union[int, tuple[int, int]],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        edge_dim: Optional[int] = None,
        fill_value: Union[float, Tensor, str] = "mean",
        bias: bool = True,
        share_weights: bool = False,
        residual: bool = False,
        *,
        config: BamConfig = SOFT,
    ) -> None:
        super().__init__(in_channels, out_channels, heads, concat, dropout, config)
        self.negative_slope, self.add_self_loops, self.edge_dim = negative_slope, add_self_loops, edge_dim
        self.fill_value, self.share_weights, self.residual = fill_value, share_weights, residual
        width = heads * out_channels
        source_channels, target_channels = (in_channels, in_channels) if isinstance(in_channels, int) else in_channels
        self.lin_l = Linear(source_channels, width, bias=bias, weight_initializer="glorot")
        self.lin_r = self.lin_l if share_weights else Linear(target_channels, width, bias=bias, weight_initializer="glorot")
        self.att = nn.Parameter(torch.empty(1, heads, out_channels))
        if edge_dim is not None:
            self.lin_edge = Linear(edge_dim, width, bias=False, weight_initializer="glorot")
        total_out = width if concat else out_channels
        self.res = Linear(target_channels, total_out, bias=False, weight_initializer="glorot") if residual else None
        self.bias = nn.Parameter(torch.empty(total_out)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for lin in (self.lin_l, self.lin_r, self.lin_edge, self.res):
            if lin is not None:
                lin.reset_parameters()
        glorot(self.att)
        zeros(self.bias)

    def forward(
        self,
        x: NodeInput,
        edge_index: Adj,
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        return self.attend(x, edge_index, edge_attr, None, return_attention_weights)

    def project(self, x: NodeInput) -> NodeFeatures:
        x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
        if x_dst is None:
            raise ValueError("GATv2 scores every edge with its target's features: got targets None")
        h_src = heads_of(self.lin_l, x_src, self.heads)
        h_dst = h_src if self.share_weights and x_dst is x_src else heads_of(self.lin_r, x_dst, self.heads)
        return NodeFeatures(h_src, h_src, h_dst)

    def score(self, nodes: NodeFeatures, edge_index: Tensor, edge_features: Optional[Tensor]) -> Tensor:
        src, dst = edge_index
        joint = nodes.keys.index_select(-3, src) + nodes.queries.index_select(-3, dst)  # [..., E, H, C]
        if edge_features is not None:
            joint = joint + edge_features
        return (F.leaky_relu(joint, self.negative_slope) * self.att).sum(-1)

    def combine(self, out: Tensor, x_dst: Optional[Tensor]) -> Tensor:
        if self.res is not None:
            out = out + self.res(x_dst)
        return out if self.bias is None else out + self.bias


class BayesianTransformerConv(EdgeAttentionConv):
    """PyG's ``TransformerConv`` with Bayesian attention weights (see the module doc). No
    self-loops are added, as in PyG's layer."""

    edge_features_in_messages = True
    add_self_loops = False

    def __init__(
        self,
        in_channels: Union[int, tuple[int, int]],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        beta: bool = False,
        dropout: float = 0.0,
        edge_dim: Optional[int] = None,
        bias: bool = True,
        root_weight: bool = True,
        *,
        config: BamConfig = SOFT,
    ) -> None:
        super().__init__(in_channels, out_channels, heads, concat, dropout, config)
        self.beta, self.root_weight, self.edge_dim = beta and root_weight, root_weight, edge_dim
        source_channels, target_channels = (in_channels, in_channels) if isinstance(in_channels, int) else in_channels
        width = heads * out_channels
        self.lin_key = Linear(source_channels, width, bias=bias)
        self.lin_query = Linear(target_channels, width, bias=bias)
        self.lin_value = Linear(source_channels, width, bias=bias)
        if edge_dim is not None:
            self.lin_edge = Linear(edge_dim, width, bias=False)
        total_out = width if concat else out_channels
        self.lin_skip = Linear(target_channels, total_out, bias=bias)
        self.lin_beta = Linear(3 * total_out, 1, bias=False) if self.beta else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for lin in (self.lin_key, self.lin_query, self.lin_value, self.lin_edge, self.lin_skip, self.lin_beta):
            if lin is not None:
                lin.reset_parameters()

    def forward(
        self,
        x: NodeInput,
        edge_index: Adj,
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        # as TransformerConv: any bool, False too, asks for the weights (GATConv's asks only with True)
        return self.attend(x, edge_index, edge_attr, None, isinstance(return_attention_weights, bool))

    def project(self, x: NodeInput) -> NodeFeatures:
        x_src, x_dst = (x, x) if isinstance(x, Tensor) else x
        if x_dst is None:
            raise ValueError("the graph transformer's queries are its targets' features: got targets None")
        keys, values = heads_of(self.lin_key, x_src, self.heads), heads_of(self.lin_value, x_src, self.heads)
        return NodeFeatures(keys, values, heads_of(self.lin_query, x_dst, self.heads))

    def score(self, nodes: NodeFeatures, edge_index: Tensor, edge_features: Optional[Tensor]) -> Tensor:
        src, dst = edge_index
        keys = nodes.keys.index_select(-3, src)  # [..., E, H, C]
        if edge_features is not None:
            keys = keys + edge_features
        return (nodes.queries.index_select(-3, dst) * keys).sum(-1) / math.sqrt(self.out_channels)

    def combine(self, out: Tensor, x_dst: Optional[Tensor]) -> Tensor:
        if not self.root_weight:
            return out
        skip = self.lin_skip(x_dst)
        if self.lin_beta is None:
            return out + skip
        gate = self.lin_beta(torch.cat([out, skip, out - skip], dim=-1)).sigmoid()
        return gate * skip + (1 - gate) * out
