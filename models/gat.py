"""The graph attention network of the paper's node classification (Velickovic et al. 2018), built
from :class:`bam_pyro.pyg.BayesianGATConv` layers, and its Pyro model."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.utils import add_self_loops, remove_self_loops

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.pyg import BayesianGATConv, NodeClassifier


class GAT(nn.Module):
    """Two-layer GAT: Bayesian GAT layer (heads concatenated), ELU, output layer; each layer drops
    its input and its attention weights.

    ``dropout_per_head`` (the default, as in the original GAT code): each head draws its own input
    mask and also drops its projected features. ``False``: one input mask serves all heads, as in
    PyG's GAT example.

    ``add_self_loops``: each layer replaces the graph's self-loops (as ``GATConv``). ``False`` for an
    ``edge_index`` that already holds exactly one loop per node (:func:`with_self_loops`): the
    same outputs, and no edge selection of data-dependent size per call, which ``torch.compile``
    cannot put in one graph.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        config: BamConfig,
        hidden: int = 8,
        heads: int = 8,
        out_heads: int = 1,
        dropout: float = 0.6,
        dropout_per_head: bool = True,
        add_self_loops: bool = True,
    ) -> None:
        super().__init__()
        layer = dict(dropout=dropout, config=config, input_dropout=dropout, dropout_per_head=dropout_per_head,
                     add_self_loops=add_self_loops)
        self.conv1 = BayesianGATConv(in_channels, hidden, heads, concat=True, **layer)
        self.conv2 = BayesianGATConv(hidden * heads, num_classes, out_heads, concat=False, **layer)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        # in place: the first layer's output is a fresh tensor no backward pass reads
        return self.conv2(F.elu(self.conv1(x, edge_index), inplace=True), edge_index)


def build_node_classifier(
    in_channels: int,
    num_classes: int,
    config: BamConfig,
    objective: ObjectiveConfig,
    heads: int = 8,
    hidden: int = 8,
    out_heads: int = 1,
    dropout: float = 0.6,
    dropout_per_head: bool = True,
    add_self_loops: bool = True,
) -> NodeClassifier:
    network = GAT(
        in_channels, num_classes, config, hidden=hidden, heads=heads, out_heads=out_heads,
        dropout=dropout, dropout_per_head=dropout_per_head, add_self_loops=add_self_loops,
    )
    return NodeClassifier(network, objective)


def with_self_loops(edge_index: Tensor, num_nodes: int) -> Tensor:
    """``edge_index`` with its self-loops replaced by one per node, as each ``GATConv`` layer does
    it: done once, for a GAT built with ``add_self_loops=False``."""
    return add_self_loops(remove_self_loops(edge_index)[0], num_nodes=num_nodes)[0]
