"""The one rule for per-pass state: what a forward pass reads without its arguments carrying it.

Some settings reach code deep inside a network that its callers cannot pass down: the attention
sites of the Pyro model around the pass (:mod:`bam_pyro.sites`), the seed rows of a sampled
subgraph (:mod:`bam_pyro.pyg.edge_keys`), the checkpointed layer being recomputed
(:mod:`bam_pyro.transformers.checkpointing`), whether the fused path's noise is compiled
(:mod:`bam_pyro.fused`). Each is a :class:`PassContext`: a ``with`` block sets it, the code inside
reads the innermost value, and leaving the block restores the one before.

The values are per thread (a ``threading.local``): a pass in one thread does not see the context
of another. ``torch.compile`` traces a ``threading.local`` without a graph break (it stops at
``ContextVar.get``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class PassContext(threading.local, Generic[T]):
    """A per-thread stack of values, entered with :meth:`entered`; :meth:`current` is the innermost
    value, or ``default`` outside every block (a thread starts outside)."""

    def __init__(self, default: T) -> None:
        self.default = default
        self.stack: list[T] = []

    @contextmanager
    def entered(self, value: T) -> Iterator[T]:
        """``value`` is this thread's current value within the block."""
        self.stack.append(value)
        try:
            yield value
        finally:
            self.stack.pop()

    def current(self) -> T:
        return self.stack[-1] if self.stack else self.default
