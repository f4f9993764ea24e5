"""What several tasks' training shares: a variant's model, guide and ELBO (:class:`Trainable`), the
epoch loop with its evaluation timed apart (:func:`fit_epochs`), and parameter counts."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, NamedTuple, Optional, Protocol

import numpy as np
import torch
from pyro.infer import ELBO

from bam_pyro import BamModel
from bam_pyro.training import EarlyStopping, SVITrainer
from experiments.runner.task import RunContext


class Trainable(NamedTuple):
    """A variant's Pyro model and guide and the ELBO it trains with (None: the library's default,
    analytic KL at attention sites)."""

    model: BamModel
    guide: Callable
    elbo: Optional[ELBO] = None


class Batch(Protocol):
    model_args: Any


class TrainingSplit(Protocol):
    """A training split that deals its examples into shuffled batches."""

    def training_batches(self, batch_size: int, rng: np.random.Generator) -> Iterable[Batch]: ...


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def fit_epochs(trainer: SVITrainer, run: RunContext, split: TrainingSplit, batch_size: int, batches_per_epoch: int,
               evaluate: Callable[[], dict[str, float]], max_epochs: int, stopping: EarlyStopping) -> dict[str, float]:
    """Train by epochs of ``split``'s batches, shuffled by (seed, epoch) so that a resumed run deals
    the same ones, with ``evaluate`` after each epoch (its seconds recorded as ``eval_seconds``);
    leave the model in eval mode. Returns the run's speed and size: ``seconds_per_step`` (each
    process's SVI steps, evaluation left out) and ``parameters``.
    ``batches_per_epoch``: the batches of an epoch over all processes."""
    seed = run.settings.seed

    def batches():
        rng = np.random.default_rng([seed, trainer.epoch])
        return (batch.model_args for batch in split.training_batches(batch_size, rng))

    def timed_evaluation() -> dict[str, float]:
        start = time.perf_counter()
        return {**evaluate(), "eval_seconds": time.perf_counter() - start}

    result = trainer.fit(batches, timed_evaluation, max_epochs, stopping, progress=run.progress,
                         description=run.description, steps_per_epoch=batches_per_epoch)
    training_seconds = result.seconds - sum(record["eval_seconds"] for record in result.history)
    trainer.model.eval()
    return {"seconds_per_step": training_seconds / (result.epochs * run.steps_per_process(batches_per_epoch)),
            "parameters": count_parameters(trainer.model)}
