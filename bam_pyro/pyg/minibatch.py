"""The ELBO of a neighbour-sampled mini-batch, scaled so that it is unbiased for the full graph's.

Seeds are drawn from a set I of ``N_in`` nodes (all nodes, or the training nodes), of which the set
Y of ``n_Y`` is labelled. The graph's ELBO (``sum`` reduction) over I is

    L = sum_{i in Y} log p(y_i | x, S) - lambda_t * sum_l sum_{v in I} KL_lv

with ``KL_lv`` the KL of node v's row at layer l (the attention over v's incoming edges). A batch of
``b`` seeds B, drawn uniformly (or as one part of a random partition of I), gives

    L_B = (N_in / b) * [ sum_{i in B & Y} log p(y_i) - lambda_t * sum_l sum_{v in B} KL_lv ]

and since every node of I is a seed with probability ``b / N_in``, ``E[L_B] = L``; over an epoch's
partition ``sum_B (b / N_in) L_B = L`` exactly. Only the seeds' rows enter the KL: the subgraph's
other rows are needed for the seeds' outputs but belong to no seed, and counting them would weigh a
node by how often it lies near the seeds. A seed's row at every layer sees exactly what it sees in
the full graph when every neighbour is sampled (``num_neighbors`` of -1: each layer's inputs to a
seed's row come from within the sampled hops); with fewer neighbours, ``L_B`` is unbiased for the
ELBO of the sampled neighbourhoods, as any neighbour-sampled loss. Under the ``mean`` reduction the
likelihood is divided by ``n_Y`` and each layer's KL by its number of entries in the full graph
(:attr:`FullGraph.attention_entries`, per head), not the batch's.

With I the training nodes (the usual choice, and the cheap one) L leaves out the rows of the other
nodes; with I all nodes it is the full-graph objective that full-batch training optimizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from pyro.poutine.messenger import Messenger
from torch import Tensor, nn
from torch_geometric.utils import remove_self_loops

from ..config import ObjectiveConfig
from ..model import TARGET
from ..sites import SITE_INFO
from ..validation import whole_number
from .edge_keys import counted_rows
from .node_classifier import NodeClassifier


@dataclass(frozen=True)
class FullGraph:
    """What the mini-batch ELBO needs to know of the full graph.

    num_input_nodes: ``N_in``, the nodes seeds are drawn from.
    num_labelled: ``n_Y``, the labelled ones among them.
    attention_entries: entries per head of one layer's attention over the full graph (its edges,
        self-loops included where the layers add them).
    """

    num_input_nodes: int
    num_labelled: int
    attention_entries: int

    def __post_init__(self) -> None:
        for name in ("num_input_nodes", "num_labelled", "attention_entries"):
            whole_number(name, getattr(self, name))

    @classmethod
    def of(cls, edge_index: Tensor, num_nodes: int, input_nodes: Tensor, labelled: Tensor,
           self_loops: bool = True) -> "FullGraph":
        """Counts of a graph whose layers replace its self-loops by one per node (GAT's default);
        ``labelled``: a boolean mask over all nodes."""
        edges = remove_self_loops(edge_index)[0].size(1) + num_nodes if self_loops else edge_index.size(1)
        return cls(input_nodes.numel(), int(labelled[input_nodes].sum()), edges)


class SubgraphScale(Messenger):
    """Rescales the sites of one mini-batch pass: the likelihood by ``likelihood``, each attention
    site by ``attention(edges)``, ``edges`` the site's number of edges in the subgraph."""

    def __init__(self, likelihood: float, attention) -> None:
        super().__init__()
        self.likelihood, self.attention = likelihood, attention

    def _pyro_sample(self, msg) -> None:  # the handler Pyro's Messenger subclasses override (tests/test_private_names.py)
        infer = msg["infer"] or {}
        if SITE_INFO in infer:
            msg["scale"] = msg["scale"] * self.attention(infer[SITE_INFO].phi.size(-2))
        elif infer.get(TARGET):
            msg["scale"] = msg["scale"] * self.likelihood


class SubgraphNodeClassifier(NodeClassifier):
    """:class:`NodeClassifier` that also trains on neighbour-sampled subgraphs (see the module doc).

    ``model(x, edge_index, y, nodes, num_seeds=b)``: a subgraph whose first ``b`` nodes are the
    seeds (``NeighborLoader``'s layout) and ``nodes`` the positions of the labelled seeds (default:
    all seeds); its ELBO
    is scaled to be unbiased for ``full_graph``'s. Without ``num_seeds``, a whole graph, as
    :class:`NodeClassifier`.
    """

    def __init__(self, network: nn.Module, objective: ObjectiveConfig, full_graph: FullGraph) -> None:
        super().__init__(network, objective)
        self.full_graph = full_graph

    def model(self, x: Tensor, edge_index: Tensor, y: Optional[Tensor] = None, nodes: Optional[Tensor] = None,
              num_seeds: Optional[int] = None, step: Optional[int] = None) -> Any:
        if num_seeds is None:
            return super().model(x, edge_index, y=y, nodes=nodes, step=step)
        whole_number("num_seeds", num_seeds)
        if nodes is None:  # every seed labelled
            nodes = torch.arange(num_seeds, device=x.device)
        full, weight = self.full_graph, self.full_graph.num_input_nodes / num_seeds
        labelled = nodes.numel()
        if self.objective.reduction == "mean":  # observe divided by the batch's labelled, sites by the batch's entries
            scale = SubgraphScale(weight * labelled / full.num_labelled, lambda edges: weight * edges / full.attention_entries)
        else:
            scale = SubgraphScale(weight, lambda edges: weight)
        with counted_rows(num_seeds), scale:
            return super().model(x, edge_index, y=y, nodes=nodes, step=step)

    def likelihood(self, logits: Tensor, y: Optional[Tensor] = None, nodes: Optional[Tensor] = None) -> None:
        if nodes is not None and nodes.numel() == 0:
            return  # a batch of unlabelled seeds: only their KL
        super().likelihood(logits, y, nodes)
