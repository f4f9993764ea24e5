"""Posterior draws of an evaluation set split over a run's processes.

Under several processes every process holds the whole trained model, so each draws only its share
of the items (item ``i`` on process ``i % processes``, :meth:`~bam_pyro.distributed.LocalEngine.share`)
and gets everyone's results back: the draws cost what they cost in one process, divided among the
processes. Each item is drawn with its own seed, derived from the run's seed and the item's index
(:func:`~bam_pyro.training.stream_seed`), under :func:`~bam_pyro.training.share_seeded`: what an item draws
does not depend on which process drew it or what ran before, so the gathered draws are exactly one
process's. The draws run the model itself (never the data-parallel wrapper the trainer steps through,
whose forward can synchronize the processes: DDP may broadcast buffers before a pass), without gradients.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

from bam_pyro.distributed import Engine
from bam_pyro.training import share_seeded, stream_seed

T = TypeVar("T")


def shared_draws(draw: Callable[[int], T], count: int, seed: int, engine: Optional[Engine] = None) -> list[T]:
    """``[draw(i) for i in range(count)]`` on every process of ``engine`` (default: this one), each
    process drawing its share, item ``i`` seeded by ``(seed, i)``; ``draw`` returns CPU values."""

    def item(index: int) -> T:
        with torch.no_grad():
            return draw(index)

    return share_seeded(item, [stream_seed(seed, index) for index in range(count)], engine)
