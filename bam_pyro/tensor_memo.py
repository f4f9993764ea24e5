"""Reuse what was derived from tensors while the very same tensors come back unwritten.

Transductive training hands the model one feature matrix and edge index every step; transformers
hands every layer of a forward pass one mask; a decoder attends to the same keys at every step.
What the library derives from them (a check of their values, a matrix's nonzeros, a mask's layout,
a contextual prior) need not be derived again while they are the same tensors: the same objects,
not written to in place since. Writes are counted by torch (``Tensor._version``; it has no public
twin, tests/test_private_names.py).

Inference tensors (made under ``torch.inference_mode``) count no writes: what is derived from them
is never reused, and is derived at every call. A tensor changed through ``.data`` escapes the
count, so it would escape this memo too if it came back as the same object.
"""

from __future__ import annotations

import weakref
from typing import Callable, Generic, Hashable, Optional, TypeVar

from torch import Tensor

T = TypeVar("T")


def write_count(t: Tensor) -> Optional[int]:
    """The number of in-place writes to ``t`` so far; None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


class LastTensorsMemo(Generic[T]):
    """One value derived from the tensors of the last call, handed back while the same tensors,
    unwritten since, come back with the same ``key``.

    Holds weak references: it never keeps a tensor alive, and a tensor freed and replaced by
    another at the same address is not mistaken for it. The entry is replaced whole, never changed
    in place, so a memo shared by threads hands each the value of one entry or computes its own.
    A copy (``copy.deepcopy``, pickling) starts empty: weak references do not travel."""

    def __init__(self) -> None:
        self._entry: Optional[tuple[tuple[weakref.ref, ...], tuple[int, ...], Hashable, T]] = None

    def get(self, derive: Callable[[], T], *tensors: Tensor, key: Hashable = None) -> T:
        """``derive()``, or the value it gave on the last call if that call had these very tensors,
        unwritten since, and the same ``key``. A ``derive`` that raises leaves the memo as it was."""
        counts = tuple(write_count(t) for t in tensors)
        entry = self._entry
        if (entry is not None and entry[1] == counts and entry[2] == key
                and all(ref() is t for ref, t in zip(entry[0], tensors))):
            return entry[3]
        value = derive()
        if None not in counts:
            self._entry = (tuple(weakref.ref(t) for t in tensors), counts, key, value)
        return value

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
