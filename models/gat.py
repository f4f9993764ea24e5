"""Graph attention network (Velickovic et al. 2018) with Bayesian attention, on PyG.

``BayesianGATConv`` is GAT's layer with its per-edge softmax replaced by
:class:`bam_pyro.BayesianAttention` over :class:`bam_pyro.EdgeKeys`: scores
``LeakyReLU(a_src . W h_j + a_dst . W h_i)`` per edge and head, normalized over each target's
neighbourhood, memory linear in edges. With ``variant="soft"`` it is the plain GAT layer.
Leading sample dimensions (vectorized posterior samples) broadcast through.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional, Union

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.nn.inits import glorot, zeros
from torch_geometric.utils import add_self_loops, remove_self_loops

from bam_pyro import BamConfig, BamModel, BayesianAttention, EdgeKeys, ObjectiveConfig


class BayesianGATConv(MessagePassing):
    """One graph attention layer with Bayesian attention weights.

    ``x``: ``[..., num_nodes, in_channels]`` -> ``[..., num_nodes, heads * out_channels]``
    (``concat``) or ``[..., num_nodes, out_channels]`` (heads averaged). ``dropout`` is the rate on
    the layer's input and on its attention weights; with ``dropout_per_head`` every head draws its
    own input mask and the projected features (the messages) are dropped too. As in PyG's
    ``GATConv``, self-loops are replaced by one per node unless ``add_self_loops=False``, and
    ``return_attention_weights=True`` also returns the edges with their attention weights
    (``[..., num_edges, heads]``, before dropout).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        heads: int,
        config: BamConfig,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        dropout_per_head: bool = False,
        add_self_loops: bool = True,
    ) -> None:
        super().__init__(aggr="add", node_dim=-3)
        self.heads, self.out_channels, self.concat = heads, out_channels, concat
        self.add_self_loops = add_self_loops
        self.negative_slope, self.dropout, self.dropout_per_head = negative_slope, dropout, dropout_per_head
        self.lin = Linear(in_channels, heads * out_channels, bias=False, weight_initializer="glorot")
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        self.bias = nn.Parameter(torch.empty(heads * out_channels if concat else out_channels))
        self.attention = BayesianAttention(config, heads, out_channels)
        self.input_entries = SparseEntriesCache(out_channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.lin.reset_parameters()
        glorot(self.att_src)
        glorot(self.att_dst)
        zeros(self.bias)
        if self.attention.prior_net is not None:
            self.attention.prior_net.reset_parameters()

    def forward(
        self, x: Tensor, edge_index: Tensor, return_attention_weights: bool = False
    ) -> Union[Tensor, tuple[Tensor, tuple[Tensor, Tensor]]]:
        num_nodes = x.size(-2)
        h = self.project(x)  # [..., N, H, C]
        score_src = (h * self.att_src).sum(-1)  # [..., N, H]
        score_dst = (h * self.att_dst).sum(-1)
        if self.add_self_loops:
            edge_index, _ = remove_self_loops(edge_index)
            edge_index, _ = add_self_loops(edge_index, num_nodes=num_nodes)
        src, dst = edge_index
        scores = F.leaky_relu(
            score_src.index_select(-2, src) + score_dst.index_select(-2, dst), self.negative_slope
        )  # [..., E, H]
        attention = self.attention(scores, h, EdgeKeys(edge_index, num_nodes))
        weights = F.dropout(attention, p=self.dropout, training=self.training)
        if self.dropout_per_head:
            h = F.dropout(h, p=self.dropout, training=self.training)
        out = self.propagate(edge_index, x=h, weights=weights, size=(num_nodes, num_nodes))
        out = (out.flatten(-2) if self.concat else out.mean(-2)) + self.bias
        return (out, (edge_index, attention)) if return_attention_weights else out

    def project(self, x: Tensor) -> Tensor:
        """The heads' features ``W_h dropout(x)``, one shared input mask or one per head."""
        if self.dropout_per_head and self.training and self.dropout > 0:
            entries = self.input_entries(x)
            return per_head_dropout_projection(x, self.lin.weight, self.heads, self.dropout, entries)
        x = input_dropout(x, self.dropout, self.training)
        return self.lin(x).unflatten(-1, (self.heads, self.out_channels))

    def message(self, x_j: Tensor, weights: Tensor) -> Tensor:
        return x_j * weights.unsqueeze(-1)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.lin.in_channels}, {self.out_channels}, heads={self.heads}, {self.attention.config.variant})"


def input_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Dropout of input features. For data (no gradient wanted) the mask comes from ``uniform_``,
    in the output's own buffer: the same law as ``F.dropout``, whose CPU ``bernoulli_`` takes 2.5x
    as long (on Cora's 2708 x 1433 features it was most of a GAT step)."""
    if not training or x.requires_grad or not 0.0 < p < 1.0:
        return F.dropout(x, p=p, training=training)
    kept = torch.empty_like(x).uniform_().ge_(p)  # 1.0 with probability 1 - p
    return kept.mul_(x).mul_(1.0 / (1.0 - p))


class SparseRows(NamedTuple):
    """The nonzero entries of ``x`` with its leading dimensions flattened into rows:
    ``x.reshape(-1, F)[rows, cols] == values``."""

    rows: Tensor
    cols: Tensor
    values: Tensor


def sparse_entries(x: Tensor, out_channels: int) -> Optional[SparseRows]:
    """``x``'s nonzeros when :func:`per_head_dropout_projection` should gather over them: data
    that needs no gradient and is mostly zero (bag-of-words features). The gather does
    ``nnz * H * C`` work, per-head copies ``H * N * F``, so it is chosen when ``nnz * C < N * F``.
    None otherwise."""
    # counting first keeps the rejection of dense data (e.g. hidden features under MC dropout)
    # cheap: nonzero() would build index arrays as large as the input
    if x.requires_grad or torch.count_nonzero(x) * out_channels >= x.numel():
        return None
    flat = x.reshape(-1, x.size(-1))
    rows, cols = flat.nonzero(as_tuple=True)
    return SparseRows(rows, cols, flat[rows, cols])


class SparseEntriesCache:
    """A layer's :func:`sparse_entries` of its last input, reused while that same tensor comes
    back unchanged. In transductive training the first layer reads one feature matrix every step;
    finding its nonzeros anew each time cost about a fifth of a Cora BAM-WC step (README,
    benchmarks). Holds a weak reference: the cache never keeps an input alive."""

    def __init__(self, out_channels: int) -> None:
        self.out_channels = out_channels
        self._source: Optional[weakref.ref] = None
        self._version = -1
        self._entries: Optional[SparseRows] = None

    def __call__(self, x: Tensor) -> Optional[SparseRows]:
        if x.is_inference() or x.requires_grad:  # no version counter to key on / never gathered
            return sparse_entries(x, self.out_channels)
        if self._source is None or self._source() is not x or self._version != x._version:
            self._source, self._version = weakref.ref(x), x._version  # _version counts in-place writes
            self._entries = sparse_entries(x, self.out_channels)
        return self._entries

    def __getstate__(self) -> dict:
        return {"out_channels": self.out_channels}  # weak references do not pickle: a copy starts empty

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["out_channels"])


def per_head_dropout_projection(
    x: Tensor, weight: Tensor, heads: int, p: float, entries: Optional[SparseRows] = None
) -> Tensor:
    """``W_h (m_h * x) / (1 - p)`` for every head h with its own Bernoulli(1 - p) mask ``m_h``: the
    original GAT, where each head drops its own copy of the layer's input.

    ``x``: ``[..., N, F]``; ``weight``: ``[heads * C, F]`` -> ``[..., N, heads, C]``. Given ``x``'s
    nonzeros (``entries``, from :func:`sparse_entries`) the masks are drawn only there and the
    weight's columns gathered, so eight masks cost less than one dense mask; without them every
    head drops a copy of ``x``.
    """
    out_channels = weight.size(0) // heads
    w = weight.view(heads, out_channels, -1)  # [H, C, F]
    if entries is not None:
        rows, cols, values = entries
        kept = torch.empty(rows.numel(), heads, 1, dtype=x.dtype, device=x.device).uniform_().ge_(p)
        kept.mul_(values.mul(1.0 / (1.0 - p)).view(-1, 1, 1))
        contributions = w.permute(2, 0, 1).index_select(0, cols) * kept  # [nnz, H, C]
        num_rows = x.numel() // x.size(-1)
        out = x.new_zeros(num_rows, heads, out_channels).index_add(0, rows, contributions)
        return out.view(*x.shape[:-1], heads, out_channels)
    if heads > 1 and torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        # the backward pass would keep all H dropped copies of x; drawing them again there (same
        # RNG state, so the same masks) keeps none
        return checkpoint(_dropped_copies_projection, x, w, p, use_reentrant=False)
    return _dropped_copies_projection(x, w, p)


def _dropped_copies_projection(x: Tensor, w: Tensor, p: float) -> Tensor:
    """``x``: ``[..., N, F]``, ``w``: ``[H, C, F]`` -> ``[..., N, H, C]``, each head projecting its
    own dropped copy of ``x``."""
    copies = x.unsqueeze(-3).expand(*x.shape[:-2], w.size(0), *x.shape[-2:])
    return torch.einsum("...hnf,hcf->...nhc", F.dropout(copies, p, training=True), w)


class GAT(nn.Module):
    """Two-layer GAT: Bayesian GAT layer (heads concatenated), ELU, output layer; each layer drops
    its input and its attention weights.

    ``dropout_per_head`` (the default, as in the original GAT code): each head draws its own input
    mask and also drops its projected features. ``False``: one input mask serves all heads, as in
    PyG's GAT example.
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
    ) -> None:
        super().__init__()
        drop = dict(dropout=dropout, dropout_per_head=dropout_per_head)
        self.conv1 = BayesianGATConv(in_channels, hidden, heads, config, concat=True, **drop)
        self.conv2 = BayesianGATConv(hidden * heads, num_classes, out_heads, config, concat=False, **drop)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.conv2(F.elu(self.conv1(x, edge_index)), edge_index)


class NodeClassifier(BamModel):
    """Pyro model for transductive node classification: labels of the chosen nodes are observed.

    ``model(x, edge_index, y=None, nodes=idx)``: ``y ~ Categorical(logits[nodes])``.
    """

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
) -> NodeClassifier:
    network = GAT(
        in_channels, num_classes, config, hidden=hidden, heads=heads, out_heads=out_heads,
        dropout=dropout, dropout_per_head=dropout_per_head,
    )
    return NodeClassifier(network, objective)
