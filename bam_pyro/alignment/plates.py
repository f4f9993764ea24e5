"""The plates of a sequence-to-sequence likelihood: sentences x target positions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pyro
from pyro import poutine
from torch import Tensor


@contextlib.contextmanager
def target_plates(tgt_mask: Tensor, reduction: str) -> Iterator[None]:
    """Plates ``sentences`` (dim -2) x ``positions`` (dim -1) over the target tokens, padding masked
    out and, under the ``mean`` reduction, each token weighted 1 / (number of tokens). Every model
    of the translation task (soft/BAM and the latent alignments) scores its tokens inside these."""
    scale = 1.0 / max(int(tgt_mask.sum()), 1) if reduction == "mean" else 1.0
    batch, length = tgt_mask.shape
    with pyro.plate("sentences", batch, dim=-2), pyro.plate("positions", length, dim=-1), \
            poutine.mask(mask=tgt_mask), poutine.scale(scale=scale):
        yield
