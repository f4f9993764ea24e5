"""The plates of a sequence-to-sequence likelihood: sentences x target positions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pyro
import torch
from pyro import poutine
from torch import Tensor

from ..sites import mean_scale


@contextlib.contextmanager
def target_plates(tgt_mask: Tensor, reduction: str) -> Iterator[None]:
    """Plates ``sentences`` (dim -2) x ``positions`` (dim -1) over the target tokens, padding masked
    out and, under the ``mean`` reduction, each token weighted 1 / (number of tokens). Every model
    of the translation task (soft/BAM and the latent alignments) scores its tokens inside these."""
    scale = mean_scale(1.0, 1, tgt_mask.sum(), torch.float64) if reduction == "mean" else 1.0  # no host read
    batch, length = tgt_mask.shape
    with pyro.plate("sentences", batch, dim=-2), pyro.plate("positions", length, dim=-1), \
            poutine.mask(mask=tgt_mask), poutine.scale(scale=scale):
        yield
