"""When the library reads tensor values on the host (Python ``if`` on a tensor, ``int(t)``).

Such a read is free for an eager CPU tensor. On an accelerator it waits for the device to finish
the queued work (a host synchronization: the host stops queueing ahead); a ``meta`` tensor has no
values to read; under ``torch.compile`` it breaks the graph. The library therefore reads values
only where :func:`values_at_hand` says it is free, and otherwise takes a branch-free path with the
same result, and it runs checks of user data (which raise clear errors) as
:func:`value_checks_enabled` says.
"""

from __future__ import annotations

import torch
from pyro.infer.util import is_validation_enabled
from torch import Tensor


def values_at_hand(t: Tensor) -> bool:
    """Whether Python may branch on the values of ``t`` at no cost: an eager CPU tensor."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def value_checks_enabled(t: Tensor) -> bool:
    """Whether to check the values of user data ``t`` for a clear error: always where the read is
    free (:func:`values_at_hand`); on an accelerator only while Pyro's validation is on
    (``pyro.enable_validation``, on by default; :class:`bam_pyro.elbo.AttentionMeanFieldELBO` turns it
    off after its first, validated step); never on ``meta`` or under ``torch.compile``."""
    if values_at_hand(t):
        return True
    return t.device.type != "meta" and not torch.compiler.is_compiling() and is_validation_enabled()
