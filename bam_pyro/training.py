"""A generic SVI training loop: early stopping, progress, checkpoint and exact resume.

One step is ``loss = elbo.differentiable_loss(model.model, guide, *args, **kwargs)`` (by default
:class:`~bam_pyro.elbo.AttentionMeanFieldELBO`: ``TraceMeanField_ELBO``'s loss, validated on the
first step, without the densities it does not use), a backward
pass and an optimizer step on the model's parameters (a plain ``torch.optim`` optimizer, so that
weight decay and its state are the usual ones), then the annealing counter advances.

A checkpoint holds everything a continued run depends on: parameters, optimizer state, the
step counter (a buffer of the model), the early-stopping state with its best parameters, the
history, the elapsed time and every RNG state. Resuming from it continues bit-for-bit like the uninterrupted run.
"""

from __future__ import annotations

import copy
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import pyro
import torch
from tqdm.auto import tqdm

from .elbo import AttentionMeanFieldELBO
from .model import BamModel

Batch = tuple[tuple, dict]  # (positional args, keyword args) of one model call


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch and Pyro."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@dataclass
class EarlyStopping:
    """Stop after ``patience`` epochs without improvement of any monitored metric.

    ``monitors`` maps metric names to ``"min"`` or ``"max"``. As in the GAT reference, an epoch
    that improves (or ties) *any* metric resets the patience; one that improves *all* of them
    becomes the best epoch, whose parameters are kept.
    """

    monitors: dict[str, str]
    patience: int = 100
    best: dict[str, float] = field(default_factory=dict)
    best_epoch: int = -1
    best_state: Optional[dict[str, Any]] = None
    waited: int = 0

    def __post_init__(self) -> None:
        for name, mode in self.monitors.items():
            if mode not in ("min", "max"):
                raise ValueError(f"monitor {name!r}: mode must be 'min' or 'max', got {mode!r}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")

    def _improves(self, name: str, value: float) -> bool:
        if name not in self.best:
            return True
        return value <= self.best[name] if self.monitors[name] == "min" else value >= self.best[name]

    def update(self, metrics: dict[str, float], epoch: int, model: torch.nn.Module) -> bool:
        """Record an epoch's validation metrics; True when training should stop."""
        missing = set(self.monitors) - set(metrics)
        if missing:
            raise KeyError(f"evaluation did not return the monitored metrics {sorted(missing)}")
        better = {name: self._improves(name, metrics[name]) for name in self.monitors}
        if all(better.values()):
            self.best_epoch = epoch
            self.best_state = copy.deepcopy(model.state_dict())
        if any(better.values()):
            for name, improved in better.items():
                if improved:
                    self.best[name] = metrics[name]
            self.waited = 0
        else:
            self.waited += 1
        return self.waited >= self.patience

    def state_dict(self) -> dict[str, Any]:
        """The running record, and the monitors so a checkpoint says which way each metric improves."""
        return {k: getattr(self, k) for k in ("monitors", "best", "best_epoch", "best_state", "waited")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("monitors", self.monitors)
        if saved != self.monitors:
            raise ValueError(f"the checkpoint's run monitored {saved}, this one monitors {self.monitors}")
        for key in ("best", "best_epoch", "best_state", "waited"):
            setattr(self, key, state[key])


@dataclass
class FitResult:
    epochs: int  # epochs run in total (including those before a resume)
    best_epoch: int
    stopped_early: bool
    seconds: float  # wall time of the run (including the part before a resume)
    history: list[dict[str, float]]


class SVITrainer:
    """Trains a :class:`~bam_pyro.model.BamModel` with its guide by SVI.

    ``checkpoint``: file to save the full training state to every ``checkpoint_every`` epochs
    and at the end; if it exists when :meth:`fit` starts, the run resumes from it.
    """

    def __init__(
        self,
        model: BamModel,
        guide: Callable,
        optimizer: torch.optim.Optimizer,
        elbo: Optional[pyro.infer.ELBO] = None,
        checkpoint: Optional[os.PathLike] = None,
        checkpoint_every: int = 50,
        grad_clip: Optional[float] = None,
    ) -> None:
        self.model, self.guide, self.optimizer = model, guide, optimizer
        self.elbo = elbo or AttentionMeanFieldELBO()
        self.checkpoint = Path(checkpoint) if checkpoint else None
        self.checkpoint_every = checkpoint_every
        self.grad_clip = grad_clip
        self.epoch = 0
        self.history: list[dict[str, float]] = []
        self.seconds = 0.0  # wall time of the run so far, carried over by a checkpoint

    def step(self, *args: Any, **kwargs: Any) -> float:
        """One SVI step on one batch; returns the loss (negative ELBO under the objective)."""
        self.model.train()
        loss = self.elbo.differentiable_loss(self.model.model, self.guide, *args, **kwargs)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} at step {int(self.model.step)}; check the inputs "
                "and the hyperparameters (k, sigma, beta, alpha, learning rate)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.model.step += 1
        return loss.item()

    def fit(
        self,
        batches: Callable[[], Iterable[Batch]],
        evaluate: Callable[[], dict[str, float]],
        max_epochs: int,
        early_stopping: Optional[EarlyStopping] = None,
        progress: bool = True,
        description: str = "train",
        steps_per_epoch: Optional[int] = None,
    ) -> FitResult:
        """Train for up to ``max_epochs`` epochs, each one pass over ``batches()`` followed by
        ``evaluate()`` (called in eval mode, returns validation metrics). At the end the model holds
        the best epoch's parameters when early stopping is on. With ``steps_per_epoch`` (epochs of
        many batches), a second progress bar follows the steps of the current epoch."""
        if self.checkpoint is not None and self.checkpoint.exists():
            self.load(self.checkpoint, early_stopping)
        start = time.perf_counter() - self.seconds  # the run's clock, a resumed run's included
        stopped = early_stopping is not None and early_stopping.waited >= early_stopping.patience
        bar = tqdm(total=max_epochs, initial=self.epoch, desc=description, disable=not progress, dynamic_ncols=True, leave=False)
        while self.epoch < max_epochs and not stopped:
            epoch_batches = batches()
            if progress and steps_per_epoch:
                epoch_batches = tqdm(epoch_batches, total=steps_per_epoch, desc=f"epoch {self.epoch + 1}", dynamic_ncols=True, leave=False)
            losses = [self.step(*args, **kwargs) for args, kwargs in epoch_batches]
            self.model.eval()
            with torch.no_grad():
                metrics = evaluate()
            record = {"epoch": self.epoch, "loss": float(np.mean(losses)), **metrics}
            self.history.append(record)
            if early_stopping is not None:
                stopped = early_stopping.update(metrics, self.epoch, self.model)
            self.epoch += 1
            self.seconds = time.perf_counter() - start
            bar.set_postfix({k: f"{v:.4g}" for k, v in record.items() if k != "epoch"}, refresh=False)
            bar.update(1)  # draws the bar with this epoch's figures
            if self.checkpoint is not None and (self.epoch % self.checkpoint_every == 0 or stopped):
                self.save(self.checkpoint, early_stopping)
        bar.close()
        self.seconds = time.perf_counter() - start
        if self.checkpoint is not None:
            self.save(self.checkpoint, early_stopping)
        best_epoch = self.epoch - 1
        if early_stopping is not None and early_stopping.best_state is not None:
            self.model.load_state_dict(early_stopping.best_state)
            best_epoch = early_stopping.best_epoch
        return FitResult(self.epoch, best_epoch, stopped, self.seconds, self.history)

    def state_dict(self, early_stopping: Optional[EarlyStopping] = None) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epoch": self.epoch,
            "history": self.history,
            "seconds": self.seconds,
            "early_stopping": early_stopping.state_dict() if early_stopping else None,
            "rng": rng_state(),
        }

    def save(self, path: os.PathLike, early_stopping: Optional[EarlyStopping] = None) -> None:
        """Write the full training state atomically (a crash mid-write keeps the old file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(self.state_dict(early_stopping), tmp)
        os.replace(tmp, path)

    def load(self, path: os.PathLike, early_stopping: Optional[EarlyStopping] = None) -> None:
        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch, self.history = state["epoch"], state["history"]
        self.seconds = state.get("seconds", 0.0)  # absent from checkpoints written before it was kept
        if early_stopping is not None and state["early_stopping"] is not None:
            early_stopping.load_state_dict(state["early_stopping"])
        set_rng_state(state["rng"])

