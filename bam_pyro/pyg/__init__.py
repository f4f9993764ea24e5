"""Bayesian attention for PyTorch Geometric: drop-ins for ``GATConv``, ``GATv2Conv`` and
``TransformerConv`` on PyG's ``MessagePassing``, the edge attention axis they share, and the Pyro
model of node classification, on the whole graph or on neighbour-sampled mini-batches. Needs
``torch_geometric`` (``pip install 'bam-pyro[pyg]'``)."""

from ..optional import require

require("torch_geometric", "bam_pyro.pyg")

from .attention_convs import BayesianGATv2Conv, BayesianTransformerConv  # noqa: E402
from .edge_attention import EdgeAttentionConv, set_bag_draws  # noqa: E402
from .edge_keys import EdgeKeys, counted_rows  # noqa: E402
from .gat_conv import BayesianGATConv  # noqa: E402
from .minibatch import FullGraph, SubgraphNodeClassifier  # noqa: E402
from .node_classifier import NodeClassifier, validate_graph  # noqa: E402
from .sampling import NeighborBatches, neighbor_loader_available  # noqa: E402

__all__ = [
    "BayesianGATConv",
    "BayesianGATv2Conv",
    "BayesianTransformerConv",
    "EdgeAttentionConv",
    "EdgeKeys",
    "FullGraph",
    "NeighborBatches",
    "NodeClassifier",
    "SubgraphNodeClassifier",
    "counted_rows",
    "neighbor_loader_available",
    "set_bag_draws",
    "validate_graph",
]
