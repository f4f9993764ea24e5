"""Gathers and sums of rows over the edges, kept as ATen calls when ``torch.compile`` runs on CPU.

Graph attention moves rows between nodes and edges along one dimension: it gathers node rows onto
the edges (``index_select``) and sums edge rows into their targets (``index_add``), and each is the
other's gradient. Inductor's CPU backend lowers both into loops of its own, which ran slower than
ATen's kernels on the GAT's shapes (rows of 1 to 64 floats): in the per-head dropout projection
of Cora's features it vectorized over the *index* dimension, so that every element was a scalar
gather and a scalar scatter, 16 ms a step against ATen's few (torch 2.13; the benchmarks page,
"Compiled GAT").

:func:`gather_rows` and :func:`sum_rows` are ``index_select`` and ``index_add`` into zeros. Eager
they are those calls; traced by ``torch.compile`` for a CPU tensor they are the custom operators
``bam_pyro::gather_rows`` and ``bam_pyro::sum_rows``, which Inductor leaves to ATen while it fuses
the element-wise work around them; the gradient of each is the other. :func:`group_sums`, the
two in a row (the sum over each target's edges, back on the edges), is one operator,
``bam_pyro::group_sums``, its own gradient. On an accelerator the
compiled graph keeps torch's own ops (Inductor's GPU gathers and atomic adds are its strength).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("bam_pyro::gather_rows", mutates_args=())
def _gather_rows_op(src: Tensor, dim: int, index: Tensor) -> Tensor:
    return src.index_select(dim, index)


@_gather_rows_op.register_fake
def _(src: Tensor, dim: int, index: Tensor) -> Tensor:
    shape = list(src.shape)
    shape[dim] = index.numel()
    return src.new_empty(shape)


@torch.library.custom_op("bam_pyro::sum_rows", mutates_args=())
def _sum_rows_op(src: Tensor, dim: int, index: Tensor, size: int) -> Tensor:
    shape = list(src.shape)
    shape[dim] = size
    return src.new_zeros(shape).index_add_(dim, index, src)


@_sum_rows_op.register_fake
def _(src: Tensor, dim: int, index: Tensor, size: int) -> Tensor:
    shape = list(src.shape)
    shape[dim] = size
    return src.new_empty(shape)


@torch.library.custom_op("bam_pyro::group_sums", mutates_args=())
def _group_sums_op(src: Tensor, dim: int, index: Tensor, size: int) -> Tensor:
    shape = list(src.shape)
    shape[dim] = size
    return src.new_zeros(shape).index_add_(dim, index, src).index_select(dim, index)


@_group_sums_op.register_fake
def _(src: Tensor, dim: int, index: Tensor, size: int) -> Tensor:
    return torch.empty_like(src, memory_format=torch.contiguous_format)


def _save_index(ctx, inputs, output) -> None:
    src, dim, index = inputs[:3]
    ctx.save_for_backward(index)
    ctx.dim, ctx.size = dim, src.shape[dim]


def _gather_rows_backward(ctx, grad: Tensor):
    (index,) = ctx.saved_tensors
    return _sum_rows_op(grad, ctx.dim, index, ctx.size), None, None


def _sum_rows_backward(ctx, grad: Tensor):
    (index,) = ctx.saved_tensors
    return _gather_rows_op(grad, ctx.dim, index), None, None, None


def _group_sums_backward(ctx, grad: Tensor):
    (index,) = ctx.saved_tensors
    return _group_sums_op(grad, ctx.dim, index, ctx.num_groups), None, None, None


def _save_groups(ctx, inputs, output) -> None:
    _, dim, index, size = inputs
    ctx.save_for_backward(index)
    ctx.dim, ctx.num_groups = dim, size


_group_sums_op.register_autograd(_group_sums_backward, setup_context=_save_groups)
_gather_rows_op.register_autograd(_gather_rows_backward, setup_context=_save_index)
_sum_rows_op.register_autograd(_sum_rows_backward, setup_context=_save_index)


def _as_operator(t: Tensor) -> bool:
    """Whether the call is being traced by ``torch.compile`` for a CPU tensor."""
    return torch.compiler.is_compiling() and t.device.type == "cpu"


def gather_rows(src: Tensor, dim: int, index: Tensor) -> Tensor:
    """``src.index_select(dim, index)``: the rows ``index`` of ``src`` along ``dim``."""
    if _as_operator(src):
        return _gather_rows_op(src, dim, index)
    return src.index_select(dim, index)


def sum_rows(src: Tensor, dim: int, index: Tensor, size: int) -> Tensor:
    """The rows of ``src`` along ``dim`` summed into ``size`` rows, row ``i`` into row ``index[i]``
    (``index_add`` into zeros; a scatter sum)."""
    if _as_operator(src):
        return _sum_rows_op(src, dim, index, size)
    shape = list(src.shape)
    shape[dim] = size
    return src.new_zeros(shape).index_add_(dim, index, src)


def group_sums(src: Tensor, dim: int, index: Tensor, size: int) -> Tensor:
    """Each row of ``src`` along ``dim`` replaced by the sum of the rows with the same index
    (``index`` in ``[0, size)``): :func:`sum_rows`, then :func:`gather_rows` back. Its own
    gradient (the map is symmetric), one operator where two would be called."""
    if _as_operator(src):
        return _group_sums_op(src, dim, index, size)
    return gather_rows(sum_rows(src, dim, index, size), dim, index)
