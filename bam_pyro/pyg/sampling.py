"""Neighbour-sampled mini-batches of a graph, in the layout of PyG's ``NeighborLoader``.

``NeighborLoader`` needs ``pyg-lib`` or ``torch-sparse``; :class:`NeighborBatches` uses it where
either is installed and a pure-torch sampler otherwise, with the same output: a ``Data`` whose
first ``batch_size`` nodes are the seeds (``n_id[:batch_size]``), the node attributes of the sampled
nodes, and the sampled edges in local indices (``edge_index``, ``e_id``). From each node of hop
``h - 1`` (the seeds at hop 1) ``num_neighbors[h - 1]`` of its incoming edges are drawn without
replacement (all of them for -1 or a smaller in-degree), so a network of ``len(num_neighbors)``
message-passing layers computes the seeds' outputs from their sampled neighbourhoods.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch_geometric import typing as pyg_typing
from torch_geometric.data import Data

from ..validation import require, whole_number


def neighbor_loader_available() -> bool:
    """Whether PyG's ``NeighborLoader`` can sample here (it needs pyg-lib or torch-sparse)."""
    return bool(pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE)


class InEdges:
    """A graph's incoming edges grouped by target (CSR over targets), built once."""

    def __init__(self, edge_index: Tensor, num_nodes: int) -> None:
        target = edge_index[1]
        self.edge_ids = torch.argsort(target, stable=True)
        self.sources = edge_index[0].index_select(0, self.edge_ids)
        degree = torch.bincount(target, minlength=num_nodes)
        self.rowptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=edge_index.device)
        torch.cumsum(degree, 0, out=self.rowptr[1:])

    def sample(self, nodes: Tensor, fanout: int) -> Tensor:
        """Positions (into ``sources`` / ``edge_ids``) of up to ``fanout`` incoming edges of each
        of ``nodes``, drawn without replacement (all for ``fanout < 0``)."""
        start, degree = self.rowptr[nodes], self.rowptr[nodes + 1] - self.rowptr[nodes]
        owner = torch.repeat_interleave(torch.arange(nodes.numel(), device=nodes.device), degree)
        first = torch.cumsum(degree, 0) - degree  # where each node's run of edges begins
        offset = torch.arange(owner.numel(), device=nodes.device) - first[owner]
        positions = start[owner] + offset
        if fanout < 0:
            return positions
        # a random order within each node's run: sort by (owner, uniform key), keep the first fanout
        order = torch.argsort(owner.double() + torch.rand(owner.numel(), dtype=torch.double, device=nodes.device))
        return positions[order][offset < fanout]


def sample_subgraph(data: Data, edges: InEdges, seeds: Tensor, num_neighbors: Sequence[int]) -> Data:
    """The subgraph that ``num_neighbors`` hops of sampling reach from ``seeds``, laid out as a
    ``NeighborLoader`` batch (seeds first; node attributes of ``data`` indexed by ``n_id``)."""
    num_nodes = data.num_nodes
    local = torch.full((num_nodes,), -1, dtype=torch.long, device=seeds.device)
    local[seeds] = torch.arange(seeds.numel(), device=seeds.device)
    node_ids, edge_positions, frontier = [seeds], [], seeds
    sampled_nodes, sampled_edges = [seeds.numel()], []
    for fanout in num_neighbors:
        positions = edges.sample(frontier, fanout)
        sources = edges.sources[positions]
        new = torch.unique(sources[local[sources] < 0])
        local[new] = torch.arange(new.numel(), device=seeds.device) + sum(sampled_nodes)
        node_ids.append(new)
        edge_positions.append(positions)
        sampled_nodes.append(new.numel())
        sampled_edges.append(positions.numel())
        frontier = new
    n_id, positions = torch.cat(node_ids), torch.cat(edge_positions)
    e_id = edges.edge_ids[positions]
    batch = Data(edge_index=local[data.edge_index[:, e_id]], n_id=n_id, e_id=e_id, batch_size=seeds.numel(),
                 num_sampled_nodes=sampled_nodes, num_sampled_edges=sampled_edges)
    for key, value in data.items():
        if key != "edge_index" and isinstance(value, Tensor) and data.is_node_attr(key):
            batch[key] = value.index_select(0, n_id)
    return batch


class NeighborBatches:
    """Mini-batches of seed nodes with their sampled neighbourhoods, one pass over ``input_nodes``
    (all nodes by default) per iteration.

    ``num_neighbors``: incoming edges drawn per node and hop, one entry per message-passing layer
    (-1: all). ``shuffle`` draws the seeds' order from torch's global generator, so that a training
    loop that replays its random state (``SVITrainer``'s exact resume) gets the same batches.
    ``use_pyg``: PyG's ``NeighborLoader`` (True), the pure-torch sampler (False) or the former
    where it can run (None). Each batch is a ``Data`` in ``NeighborLoader``'s layout.
    """

    def __init__(
        self,
        data: Data,
        num_neighbors: Sequence[int],
        batch_size: int,
        input_nodes: Optional[Tensor] = None,
        shuffle: bool = True,
        use_pyg: Optional[bool] = None,
    ) -> None:
        whole_number("batch_size", batch_size)
        require(len(num_neighbors) > 0 and all(isinstance(n, int) and (n > 0 or n == -1) for n in num_neighbors),
                "num_neighbors", num_neighbors, "one positive count (or -1: all) per layer")
        if input_nodes is None:
            input_nodes = torch.arange(data.num_nodes, device=data.edge_index.device)
        elif input_nodes.dtype == torch.bool:
            input_nodes = input_nodes.nonzero().flatten()
        require(input_nodes.numel() > 0, "input_nodes", "empty", "at least one seed node")
        if use_pyg and not neighbor_loader_available():
            raise ImportError("PyG's NeighborLoader needs pyg-lib or torch-sparse; use_pyg=None falls back to the pure-torch sampler")
        self.data, self.num_neighbors, self.batch_size = data, list(num_neighbors), batch_size
        self.input_nodes, self.shuffle = input_nodes, shuffle
        self.use_pyg = neighbor_loader_available() if use_pyg is None else use_pyg
        self._edges = None if self.use_pyg else InEdges(data.edge_index, data.num_nodes)

    def __len__(self) -> int:
        return -(-self.input_nodes.numel() // self.batch_size)

    def __iter__(self) -> Iterator[Data]:
        if self.use_pyg:
            from torch_geometric.loader import NeighborLoader

            yield from NeighborLoader(self.data, num_neighbors=self.num_neighbors, batch_size=self.batch_size,
                                      input_nodes=self.input_nodes, shuffle=self.shuffle)
            return
        count, device = self.input_nodes.numel(), self.input_nodes.device
        order = torch.randperm(count, device=device) if self.shuffle else torch.arange(count, device=device)
        for input_id in order.split(self.batch_size):
            batch = sample_subgraph(self.data, self._edges, self.input_nodes[input_id], self.num_neighbors)
            batch.input_id = input_id  # positions of the seeds in input_nodes, as NeighborLoader gives them
            yield batch
