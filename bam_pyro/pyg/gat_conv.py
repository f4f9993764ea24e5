"""PyG's ``GATConv`` (Velickovic et al. 2018) with Bayesian attention weights.

``BayesianGATConv`` is ``GATConv`` with its per-edge softmax replaced by
:class:`bam_pyro.BayesianAttention` over :class:`bam_pyro.pyg.EdgeKeys`: a drop-in replacement that
takes the same arguments, holds the same parameters and, with soft attention, computes the same
outputs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch_geometric.nn.dense.linear import Linear, is_uninitialized_parameter
from torch_geometric.nn.inits import glorot, zeros

from ..config import BamConfig
from ..host_reads import values_at_hand
from ..tensor_memo import LastTensorsMemo
from .adjacency import Adj
from .edge_attention import SOFT, EdgeAttentionConv, NodeFeatures, NodeInput


class BayesianGATConv(EdgeAttentionConv):
    """PyG's ``GATConv`` with Bayesian attention weights: same arguments in the same order, same
    parameters, same outputs; ``config`` makes the attention stochastic.

    Scores ``LeakyReLU(a_src . W_s h_j + a_dst . W_t h_i [+ a_edge . W_e e_ji])`` per edge and head
    are normalized over each target's incoming edges by :class:`bam_pyro.BayesianAttention` over
    :class:`bam_pyro.pyg.EdgeKeys` (see :mod:`bam_pyro.pyg.edge_attention`). With the default ``config``
    (soft attention) this is ``GATConv``, parameter for parameter; with a stochastic variant each
    call is a Pyro sample site inside a :class:`bam_pyro.BamModel`, and the posterior mean (eval
    mode) is again ``GATConv``'s output.

    As in ``GATConv``: ``in_channels`` is an int, -1 (lazy) or a pair (sources, targets) for
    bipartite graphs; ``dropout`` drops the normalized attention weights; self-loops replace any
    existing ones unless ``add_self_loops=False`` (with edge features, theirs come from
    ``fill_value``); ``forward(x, edge_index, edge_attr=None, size=None,
    return_attention_weights=None)`` takes node features or a (sources, targets) pair, an
    ``edge_index``, a ``torch.sparse`` or a ``SparseTensor`` adjacency, and on request also returns
    the attention weights that weighted the messages (after dropout), as ``(edge_index,
    [num_edges, heads])`` or as a sparse adjacency like the input.

    Beyond ``GATConv`` (keywords only): ``config``, the :class:`bam_pyro.BamConfig` of the
    attention; ``input_dropout``, a dropout rate on the node features the heads project (the
    original GAT drops the layer input; ``GATConv`` leaves it to the caller); with
    ``dropout_per_head`` each head draws its own input mask and its projected features (the
    messages) are dropped too, as in the original GAT code. Node features may carry leading sample
    dimensions (``[..., num_nodes, channels]``, vectorized posterior samples): they broadcast
    through.
    """

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
        residual: bool = False,
        *,
        config: BamConfig = SOFT,
        input_dropout: float = 0.0,
        dropout_per_head: bool = False,
    ) -> None:
        super().__init__(in_channels, out_channels, heads, concat, dropout, config)
        self.negative_slope, self.add_self_loops, self.edge_dim = negative_slope, add_self_loops, edge_dim
        self.fill_value, self.residual = fill_value, residual
        self.input_dropout, self.dropout_per_head = input_dropout, dropout_per_head
        width = heads * out_channels
        self.lin = self.lin_src = self.lin_dst = None
        if isinstance(in_channels, int):
            self.lin = Linear(in_channels, width, bias=False, weight_initializer="glorot")
        else:
            self.lin_src = Linear(in_channels[0], width, bias=False, weight_initializer="glorot")
            self.lin_dst = Linear(in_channels[1], width, bias=False, weight_initializer="glorot")
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_edge = None
        if edge_dim is not None:
            self.lin_edge = Linear(edge_dim, width, bias=False, weight_initializer="glorot")
            self.att_edge = nn.Parameter(torch.empty(1, heads, out_channels))
        total_out = width if concat else out_channels
        target_channels = in_channels if isinstance(in_channels, int) else in_channels[1]
        self.res = Linear(target_channels, total_out, bias=False, weight_initializer="glorot") if residual else None
        self.bias = nn.Parameter(torch.empty(total_out)) if bias else None
        # nonzeros of the last input of each projection, for the per-head dropout
        self.source_entries, self.target_entries = SparseEntriesCache(out_channels), SparseEntriesCache(out_channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for lin in (self.lin, self.lin_src, self.lin_dst, self.lin_edge, self.res):
            if lin is not None:
                lin.reset_parameters()
        glorot(self.att_src)
        glorot(self.att_dst)
        glorot(self.att_edge)
        zeros(self.bias)

    def forward(
        self,
        x: NodeInput,
        edge_index: Adj,
        edge_attr: Optional[Tensor] = None,
        size: Optional[tuple[int, int]] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        return self.attend(x, edge_index, edge_attr, size, return_attention_weights)

    def project(self, x: NodeInput) -> NodeFeatures:
        """The heads' features ``W h`` serve as keys and values of the sources and as queries of
        the targets; one projection serves both when the graph is not bipartite."""
        if isinstance(x, Tensor):
            if self.lin is not None:
                h = self.project_with(self.lin, x, self.source_entries)
                return NodeFeatures(h, h, h)
            x = (x, x)
        x_src, x_dst = x
        lin_src = self.lin if self.lin is not None else self.lin_src
        lin_dst = self.lin if self.lin is not None else self.lin_dst
        h_src = self.project_with(lin_src, x_src, self.source_entries)
        h_dst = None if x_dst is None else self.project_with(lin_dst, x_dst, self.target_entries)
        return NodeFeatures(h_src, h_src, h_dst)

    def project_with(self, lin: Linear, x: Tensor, entries: SparseEntriesCache) -> Tensor:
        """``W_h input_dropout(x)`` for every head h, one shared input mask or one per head."""
        if self.dropout_per_head and self.training and self.input_dropout > 0:
            if is_uninitialized_parameter(lin.weight):  # lazy in_channels: what its first call would do
                lin.initialize_parameters(lin, (x,))
            return per_head_dropout_projection(x, lin.weight, self.heads, self.input_dropout, entries(x))
        x = input_dropout(x, self.input_dropout, self.training)
        return lin(x).unflatten(-1, (self.heads, self.out_channels))

    def score(self, nodes: NodeFeatures, edge_index: Tensor, edge_features: Optional[Tensor]) -> Tensor:
        src, dst = edge_index  # a_src . W h_j per node first, then per edge: no [E, H, C] tensor
        scores = (nodes.keys * self.att_src).sum(-1).index_select(-2, src)
        if nodes.queries is not None:
            scores = scores + (nodes.queries * self.att_dst).sum(-1).index_select(-2, dst)
        if edge_features is not None:
            scores = scores + (edge_features * self.att_edge).sum(-1)
        return F.leaky_relu(scores, self.negative_slope)

    def message_values(self, values: Tensor) -> Tensor:
        return F.dropout(values, p=self.input_dropout, training=self.training) if self.dropout_per_head else values

    def combine(self, out: Tensor, x_dst: Optional[Tensor]) -> Tensor:
        if self.res is not None and x_dst is not None:
            out = out + self.res(x_dst)
        return out if self.bias is None else out + self.bias


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
    None otherwise, and off eager CPU."""
    # counting first keeps the rejection of dense data (e.g. hidden features under MC dropout)
    # cheap: nonzero() would build index arrays as large as the input. Off eager CPU the count
    # would be a host read (bam_pyro.host_reads) and nonzero() a data-dependent shape: dense copies
    if x.requires_grad or not values_at_hand(x) or torch.count_nonzero(x) * out_channels >= x.numel():
        return None
    flat = x.reshape(-1, x.size(-1))
    rows, cols = flat.nonzero(as_tuple=True)
    return SparseRows(rows, cols, flat[rows, cols])


class SparseEntriesCache:
    """A layer's :func:`sparse_entries` of its last input, reused while that same tensor comes
    back unwritten (:class:`~bam_pyro.tensor_memo.LastTensorsMemo`). In transductive training the
    first layer reads one feature matrix every step; finding its nonzeros anew each time cost
    about a fifth of a Cora BAM-WC step (README, benchmarks)."""

    def __init__(self, out_channels: int) -> None:
        self.out_channels = out_channels
        self._memo: LastTensorsMemo[Optional[SparseRows]] = LastTensorsMemo()

    @torch.compiler.disable  # eager, once per input: the nonzeros' count is data-dependent (a graph break)
    def __call__(self, x: Tensor) -> Optional[SparseRows]:
        if x.requires_grad:  # never gathered (sparse_entries says None)
            return sparse_entries(x, self.out_channels)
        return self._memo.get(lambda: sparse_entries(x, self.out_channels), x)


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
        kept = _kept_values(values, heads, p)  # [nnz, H, 1]
        # [F, H, C] made contiguous first (F * H * C floats): each nonzero then gathers one
        # contiguous row of H * C weights, not H * C weights F apart
        contributions = w.permute(2, 0, 1).contiguous().index_select(0, cols) * kept  # [nnz, H, C]
        num_rows = x.numel() // x.size(-1)
        out = x.new_zeros(num_rows, heads, out_channels).index_add(0, rows, contributions)
        return out.view(*x.shape[:-1], heads, out_channels)
    if not x.requires_grad and 0.0 < p < 1.0:  # data
        if torch.is_grad_enabled() and w.requires_grad:
            return _DroppedDataProjection.apply(x, w, p)
        return _dropped_data_projection(x, w, p, keep_masks=False)[0]
    if heads > 1 and torch.is_grad_enabled():
        # the backward pass would keep all H dropped copies of x; drawing them again there (same
        # RNG state, so the same masks) keeps none
        return checkpoint(_dropped_copies_projection, x, w, p, use_reentrant=False)
    return _dropped_copies_projection(x, w, p)


@torch.compiler.disable  # see below
def _kept_values(values: Tensor, heads: int, p: float) -> Tensor:
    """``m_h * values / (1 - p)`` for every head h with its own Bernoulli(1 - p) mask ``m_h``:
    ``[nnz]`` -> ``[nnz, heads, 1]``.

    Data, which needs no gradient: drawn eagerly (ATen's ``uniform_``) also when the layer is
    compiled, so that no mask is a tensor of the graph. Inductor would keep the mask as a bool
    tensor for the backward pass, and its CPU code writes bool tensors an order of magnitude
    slower than ATen (torch 2.13: ``u >= 0.6`` into Cora's 49,216 x 8 mask took 3.7 ms compiled
    against 0.2 ms eager; the benchmarks page, "Compiled GAT"). Called right after the layer's
    nonzeros are found (also eager): no graph in between."""
    kept = torch.empty(values.numel(), heads, 1, dtype=values.dtype, device=values.device).uniform_().ge_(p)
    return kept.mul_(values.mul(1.0 / (1.0 - p)).view(-1, 1, 1))


def _dropped_copies_projection(x: Tensor, w: Tensor, p: float) -> Tensor:
    """``x``: ``[..., N, F]``, ``w``: ``[H, C, F]`` -> ``[..., N, H, C]``, each head projecting its
    own dropped copy of ``x`` (torch's dropout: features that want a gradient)."""
    copies = x.unsqueeze(-3).expand(*x.shape[:-2], w.size(0), *x.shape[-2:])
    return torch.einsum("...hnf,hcf->...nhc", F.dropout(copies, p, training=True), w)


@torch.compiler.disable  # data masks are drawn eagerly, as in _kept_values
def _dropped_data_projection(x: Tensor, w: Tensor, p: float, keep_masks: bool) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`_dropped_copies_projection` of data (no gradient wanted), head by head: each head's
    mask comes from ``uniform_`` in its copy's own buffer (as :func:`input_dropout` draws it; torch's
    ``bernoulli_`` took two fifths of a BAM-WC step on a 50,000-node graph of 128 dense features),
    one copy of ``x`` at a time, and the ``1 / (1 - p)`` goes to the weights (``C * F`` products
    a head, not ``N * F``). With ``keep_masks`` also the masks, packed eight to a byte
    (``[H, ceil(numel(x) / 8)]``)."""
    scale = 1.0 / (1.0 - p)
    outs, masks = [], []
    dropped = torch.empty_like(x)  # one buffer for every head: a large allocation faults its pages in anew
    for head_weight in w:  # [C, F]
        dropped.uniform_().ge_(p)  # 1.0 with probability 1 - p
        if keep_masks:
            masks.append(_pack_bits(dropped))
        outs.append(dropped.mul_(x) @ (head_weight * scale).T)  # [..., N, C]
    return torch.stack(outs, -2), torch.stack(masks) if keep_masks else None


class _DroppedDataProjection(torch.autograd.Function):
    """:func:`_dropped_data_projection` with a gradient for the weights. The backward pass rebuilds
    each head's dropped copy from its mask, kept as bits (``H * N * F / 8`` bytes): it keeps
    neither the copies (``H * N * F`` floats) nor draws the masks a second time, as
    checkpointing would (a second ``uniform_`` over ``H * N * F`` entries)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, p: float) -> Tensor:
        out, masks = _dropped_data_projection(x, w, p, keep_masks=True)
        ctx.save_for_backward(x, masks)
        ctx.scale, ctx.weight_dtype = 1.0 / (1.0 - p), w.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor, None]:
        x, masks = ctx.saved_tensors
        rows = x.reshape(-1, x.size(-1))
        dropped, zero = torch.empty_like(rows), rows.new_zeros(())  # one buffer for every head, as in the forward pass
        grad_w = []
        for head, mask in enumerate(masks):
            torch.where(_unpack_bits(mask, rows.shape), rows, zero, out=dropped)
            # in the gradient's dtype: under autocast the forward's products ran in bf16 or fp16
            grad_w.append(grad[..., head, :].reshape(-1, grad.size(-1)).T @ dropped.to(grad.dtype))
        return None, (torch.stack(grad_w) * ctx.scale).to(ctx.weight_dtype), None  # [H, C, F]


#: the value of each bit of a byte, lowest first
_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)


def _pack_bits(mask: Tensor) -> Tensor:
    """A 0/1 float tensor as bytes, eight entries a byte in memory order (the last byte padded)."""
    flat = mask.reshape(-1)
    if flat.numel() % 8:
        flat = torch.cat([flat, flat.new_zeros(8 - flat.numel() % 8)])
    return (flat.view(-1, 8) @ flat.new_tensor(_BIT_VALUES)).to(torch.uint8)  # exact: sums of distinct powers of 2 up to 255


def _unpack_bits(packed: Tensor, shape: torch.Size) -> Tensor:
    """The bool tensor of ``shape`` that :func:`_pack_bits` packed."""
    bits = packed.unsqueeze(-1).bitwise_and(packed.new_tensor(_BIT_VALUES)).ne_(0).view(torch.bool)  # 0/1 bytes read as bools
    return bits.reshape(-1)[: shape.numel()].view(shape)
