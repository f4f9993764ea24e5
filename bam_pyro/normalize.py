"""Normalization over each query's keys, with backward passes that keep no extra attention maps.

An attention map (``[B, H, L, L]`` dense, or ``[E, H]`` over edges) is the unit of memory of
Bayesian attention. Written as plain torch expressions, ``Phi = log(softmax(scores) + 1e-20)`` and
``W = S / sum(S)`` each leave two or three full maps saved for the backward pass; here each
saves only a tensor the step holds anyway (Phi, the guide's parameter; S, the site's value) and
recomputes the rest when the gradient is needed, if the axis says so (``recompute``: dense maps,
quadratic in the length); over edges, where entries are few, they keep the softmax instead, which
saves a segment softmax per call. Both work on any :class:`~bam_pyro.axes.AttentionAxis`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .axes import AttentionAxis
from .host_reads import values_at_hand

#: The reference code's floor inside ``log(softmax + eps)``: keeps Phi >= log(1e-20), finite
#: also on masked entries, which Pyro masks with ``torch.where`` (an inf there poisons gradients).
LOG_FLOOR = 1e-20


def _log_floored(p: Tensor, inplace: bool = False) -> Tensor:
    """``log(p + 1e-20)``, written over ``p`` if ``inplace``."""
    return (p.add_(LOG_FLOOR) if inplace else p.add(LOG_FLOOR)).log_()


class _LogNormalized(torch.autograd.Function):
    """Phi = log(p + eps), p = softmax over keys; the backward keeps Phi and recomputes p from it
    (or keeps p, if the axis does not recompute)."""

    @staticmethod
    def forward(ctx, scores: Tensor, axis: AttentionAxis) -> Tensor:
        p = axis.softmax(scores)
        phi = _log_floored(p)
        ctx.axis = axis
        ctx.save_for_backward(phi if axis.recompute else p)
        return phi

    @staticmethod
    def backward(ctx, grad_phi: Tensor) -> tuple[Tensor, None]:
        (saved,) = ctx.saved_tensors
        axis = ctx.axis
        # each map-sized intermediate is written over the one before: on CPU a fresh map costs
        # more than a pass over it (its pages faulted in anew)
        if not axis.recompute:
            p = saved
            g = torch.mul(grad_phi, p).div_(p.add(LOG_FLOOR))  # d/dp of log(p + eps), times p
            return g.sub_(p * axis.key_sum(g)), None
        shifted = torch.exp(saved)  # p + eps
        g = torch.addcdiv(grad_phi, grad_phi, shifted, value=-LOG_FLOOR)  # grad * p / (p + eps)
        # p * sum(g) with p + eps for p: off by eps * sum(g), far below float resolution
        return axis.zero_masked_keys(g.addcmul_(shifted, axis.key_sum(g), value=-1.0)), None


def log_normalized(axis: AttentionAxis, values: Tensor) -> Tensor:
    """``log(softmax(values) + 1e-20)`` over each query's keys: finite everywhere."""
    if not (torch.is_grad_enabled() and values.requires_grad):
        return _log_floored(axis.softmax(values), inplace=True)
    return _LogNormalized.apply(values, axis)


class _Normalize(torch.autograd.Function):
    """W = S / T with T the sum of S over each query's valid keys (given, computed without
    gradient); the backward keeps S and T and recomputes W (or keeps W, if the axis does not
    recompute). d W_j / d S_i = (1[i = j] - W_j) / T, so the gradient needs no division by S."""

    @staticmethod
    def forward(ctx, s: Tensor, valid: Tensor, total: Tensor, axis: AttentionAxis) -> Tensor:
        w = valid / total
        ctx.axis = axis
        ctx.save_for_backward(s if axis.recompute else w, total)
        return w

    @staticmethod
    def backward(ctx, grad_w: Tensor) -> tuple[Tensor, None, None, None]:
        saved, total = ctx.saved_tensors
        axis = ctx.axis
        weighted = saved * grad_w
        if axis.recompute:  # sum_j W_j g_j = sum_j S_j g_j / T, over valid keys
            mean_grad = axis.key_sum(axis.zero_masked_keys(weighted)) / total
        else:
            mean_grad = axis.key_sum(weighted)
        if weighted.shape == grad_w.shape:  # the gradient written over the product: no fresh map
            grad_s = torch.sub(grad_w, mean_grad, out=weighted).div_(total)
        else:
            grad_s = (grad_w - mean_grad) / total
        return axis.zero_masked_keys(grad_s), None, None, None


def normalize(axis: AttentionAxis, s: Tensor) -> Tensor:
    """``W = S / sum_keys S`` over each query's valid keys (masked keys get exactly 0).

    The ratio is taken directly where a row's sum is a positive finite float, which is the rule for
    Weibull samples; other rows are normalized in log space, as ``softmax(log S)``, with S clamped
    into the positive finite floats so that rows holding 0 or inf stay distributions (samples of a
    LogNormal prior with a huge sigma_p, such as the paper's 1e15, when the model runs without a
    guide). The backward keeps S and the sums (and W only where the axis does not recompute).

    Which rows need the log space is known only from the values. Eager on CPU one look decides
    for the whole call (the log space for all rows if any needs it). Where a look would cost a
    host synchronization (an accelerator), fail (``meta``) or break the graph (``torch.compile``),
    both are computed and each row takes its own, with no read on the host: the same weights as the
    ratio on every row that allows it, for a few more element-wise passes (fused when compiled).
    See :mod:`bam_pyro.host_reads`.
    """
    with torch.no_grad():
        valid = axis.zero_masked_keys(s)
        total = axis.key_sum(valid)
        by_ratio = (total > 0) & (total < math.inf)
    if values_at_hand(by_ratio):
        return _ratio(axis, s, valid, total) if bool(by_ratio.all()) else _in_log_space(axis, s)
    # each row through one path; the other path sees harmless values there (0 / 1, or S = 1), so
    # neither its value nor its gradient holds an inf or a NaN for torch.where to multiply by zero
    ratio = _ratio(axis, torch.where(by_ratio, s, 0.0), torch.where(by_ratio, valid, 0.0), torch.where(by_ratio, total, 1.0))
    return torch.where(by_ratio, ratio, _in_log_space(axis, torch.where(by_ratio, 1.0, s)))


def _ratio(axis: AttentionAxis, s: Tensor, valid: Tensor, total: Tensor) -> Tensor:
    """``valid / total``, with the backward of :class:`_Normalize` when S needs a gradient."""
    if not (torch.is_grad_enabled() and s.requires_grad):
        return valid / total
    return _Normalize.apply(s, valid, total, axis)


def _in_log_space(axis: AttentionAxis, s: Tensor) -> Tensor:
    """``softmax(log S)`` with S clamped into the positive finite floats."""
    info = torch.finfo(s.dtype)
    return axis.softmax(s.clamp(info.tiny, info.max).log())
