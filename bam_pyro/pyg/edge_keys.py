"""The attention axis of graph attention: the keys of a node are the sources of its incoming edges."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor
from torch_geometric.utils import scatter
from torch_geometric.utils import softmax as segment_softmax

from ..host_reads import values_at_hand
from ..pass_context import PassContext


#: largest spread of values over all edges (per head) for which EdgeKeys.softmax shifts them by one
#: shared maximum: exp of anything in (-80, 0] is a normal float32 (and bfloat16; float16 never shifts so)
SHARED_SHIFT_RANGE = 80.0


#: the number of seed nodes of a sampled subgraph whose rows alone enter the KL (:func:`counted_rows`)
_COUNTED_ROWS: PassContext[Optional[int]] = PassContext(None)


@contextmanager
def counted_rows(num_seeds: int) -> Iterator[None]:
    """Within this context, the KL of edge attention counts only the rows (incoming edges) of the
    targets ``0 .. num_seeds - 1``, the seed nodes of a neighbour-sampled subgraph; the other rows
    are computed, and weight the messages, but are masked out of the sites (see
    :mod:`bam_pyro.pyg.minibatch`). Per thread: a forward pass in another thread is not affected."""
    with _COUNTED_ROWS.entered(num_seeds):
        yield


class EdgeKeys:
    """Keys are the sources of each target's incoming edges in a PyG ``edge_index``.

    ``num_nodes`` is the number of targets (queries); the sources may be other nodes (a bipartite
    graph), per-key values then have one row per source. A graph without edges is allowed. Inside
    :func:`counted_rows` the ``mask`` leaves the rows of non-seed targets out of the KL."""

    event_dim = 2
    mask = None
    recompute = False  # entries grow with the edges only

    def __init__(self, edge_index: Tensor, num_nodes: int) -> None:
        if edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError(f"edge_index must have shape [2, num_edges], got {tuple(edge_index.shape)}")
        self.source, self.target = edge_index[0], edge_index[1]
        self.num_nodes = num_nodes
        num_seeds = _COUNTED_ROWS.current()
        if num_seeds is not None:  # [E, 1]: the rows of the seed nodes, every head
            self.mask = (self.target < num_seeds).unsqueeze(-1)

    def softmax(self, values: Tensor) -> Tensor:
        # Any shift by a constant per target gives the same softmax; the usual one, each target's
        # maximum, needs torch's scatter amax, the slowest scatter on CPU. One maximum per head
        # over all edges is as exact whenever no value lies more than SHARED_SHIFT_RANGE below it
        # (no exp under- or overflows); otherwise fall back to PyG's per-target shift. Telling
        # which needs a look at the values (bam_pyro.host_reads): eager on CPU a Python branch;
        # compiled on CPU a torch.cond, which keeps both in the graph and picks one at run time
        # (a fifth of the compiled per-target softmax's time, forward and backward, on Cora); on an
        # accelerator or meta, where the pick would be a host read, the per-target shift.
        if values.numel() == 0:  # no edges (or no heads): nothing to normalize
            return values.softmax(dim=-2)
        if torch.finfo(values.dtype).tiny > 1e-35 or values.device.type != "cpu":  # float16: exp underflows far sooner than at -80
            return self.per_target_softmax(values)
        low, high = torch.aminmax(values.detach(), dim=-2, keepdim=True)
        shared = (low > high - SHARED_SHIFT_RANGE).all()
        if not values_at_hand(shared):
            return torch.cond(shared, self.shared_shift_softmax, self.per_target_softmax, (values, high))
        return self.shared_shift_softmax(values, high) if bool(shared) else self.per_target_softmax(values)

    def shared_shift_softmax(self, values: Tensor, high: Tensor) -> Tensor:
        """The softmax over each target's edges, shifted by ``high`` (the maximum per head)."""
        shifted = torch.exp(values - high)
        return shifted / self.key_sum(shifted)

    def per_target_softmax(self, values: Tensor, high: Optional[Tensor] = None) -> Tensor:
        """PyG's softmax over each target's edges, shifted by each target's maximum (``high``
        unused: the twin of :meth:`shared_shift_softmax` for ``torch.cond``)."""
        return segment_softmax(values, self.target, num_nodes=self.num_nodes, dim=-2)

    def key_sum(self, values: Tensor) -> Tensor:
        sums = scatter(values, self.target, dim=-2, dim_size=self.num_nodes, reduce="sum")
        return sums.index_select(-2, self.target)

    def zero_masked_keys(self, values: Tensor) -> Tensor:
        return values  # every edge is a valid key

    def spread(self, per_key: Tensor) -> Tensor:
        return per_key.index_select(-2, self.source)

    def softmax_all_keys(self, per_key: Tensor) -> Tensor:
        return per_key.softmax(dim=-2)  # over all nodes of the graph

    def num_valid(self, entries: Tensor) -> int:
        # math.prod: under Pyro's provenance tracking (pyro.render_model) .shape is a plain tuple
        return math.prod(entries.shape[-2:])
