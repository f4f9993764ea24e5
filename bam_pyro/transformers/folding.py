"""Vectorized draws of a transformers model: the sample dims folded into the batch.

Pyro vectorizes draws with a plate that puts a sample dim on the left of every site
(``Predictive(parallel=True)``, ``vectorize_particles=True``), so a layer above an attention site
sees inputs ``[samples, 1, B, ...]``. transformers' models take ``[B, ...]`` only. While such
plates are active, :class:`~bam_pyro.transformers.SequenceNetwork` runs the model on its inputs
repeated once per draw (``[draws * B, ...]``, draw-major) inside :func:`folded_samples`, and each
Bayesian attention call unfolds its tensors to ``[*sample_shape, B, ...]`` around the site
(:class:`SampleFold`): every draw its own S (and dropout mask), the site's batch shape the plates'.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from pyro.poutine.runtime import get_plates
from torch import Tensor


@dataclass(frozen=True)
class SampleFold:
    """``sample_shape`` (the plates' dims, e.g. ``(draws, 1)`` for Predictive's plate beside one
    data plate) folded into a batch of ``batch_size``: ``[draws * B, ...]`` <-> ``[*sample_shape, B, ...]``."""

    sample_shape: torch.Size
    batch_size: int

    @property
    def folded_size(self) -> int:
        return math.prod(self.sample_shape) * self.batch_size

    def fold(self, value: Tensor) -> Tensor:
        """``[B, ...]`` repeated for every draw: ``[draws * B, ...]``, draw-major."""
        return value.expand(*self.sample_shape, *value.shape).reshape(self.folded_size, *value.shape[1:])

    def unfold(self, value: Tensor) -> Tensor:
        """``[draws * B, ...]`` as ``[*sample_shape, B, ...]``."""
        return value.unflatten(0, (*self.sample_shape, self.batch_size))

    def first_draw(self, value: Optional[Tensor]) -> Optional[Tensor]:
        """The ``[B, ...]`` of the first draw of a folded tensor that is the same in every draw (a mask,
        a position bias); a tensor of another batch (one shared by all, ``[1, ...]``) as it is."""
        if value is None or value.size(0) != self.folded_size:
            return value
        return value[: self.batch_size]


class _Folds(threading.local):
    def __init__(self) -> None:
        self.stack: list[SampleFold] = []


_FOLDS = _Folds()


def vectorized_sample_shape() -> torch.Size:
    """The dims that the active vectorized plates give a site outside every data plate: size of
    each plate at its dim, 1 elsewhere (``(draws, 1)`` under ``Predictive(parallel=True)`` of a
    model with one data plate); empty when no plate is active."""
    frames = [frame for frame in get_plates() if frame.vectorized and frame.dim is not None]
    if not frames:
        return torch.Size()
    shape = [1] * -min(frame.dim for frame in frames)
    for frame in frames:
        shape[frame.dim] = frame.size
    return torch.Size(shape)


@contextmanager
def folded_samples(fold: SampleFold) -> Iterator[SampleFold]:
    """Within this context (this thread's), Bayesian attention calls of transformers models unfold
    their ``[draws * B, ...]`` tensors by ``fold``."""
    _FOLDS.stack.append(fold)
    try:
        yield fold
    finally:
        _FOLDS.stack.pop()


def active_fold() -> Optional[SampleFold]:
    return _FOLDS.stack[-1] if _FOLDS.stack else None
