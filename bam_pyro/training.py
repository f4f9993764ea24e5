"""A generic SVI training loop: early stopping, progress, checkpoints by epoch and by time, exact resume.

One step is ``loss = elbo.differentiable_loss(model.model, guide, *args, **kwargs)`` (by default
:class:`~bam_pyro.elbo.AttentionMeanFieldELBO`: ``TraceMeanField_ELBO``'s loss, validated on the
first step, without the densities it does not use), a backward
pass and an optimizer step on the model's parameters (a plain ``torch.optim`` optimizer, so that
weight decay and its state are the usual ones). The trainer counts its steps in
:attr:`SVITrainer.global_step`, a Python int, and passes it to model and guide as ``step=t``, the
``t`` of the KL annealing (:meth:`bam_pyro.BamModel.kl_scale`).

A checkpoint holds everything a continued run depends on: parameters, optimizer state, the
step counter, the early-stopping state with its best parameters, the
history, the elapsed time, every RNG state and, when written inside an epoch, how far the epoch
got. It is written every ``checkpoint_every`` epochs and, with ``checkpoint_seconds``, also
between two steps once that much time has passed since the last one, so a killed run loses at
most that much work. Resuming continues bit-for-bit like the uninterrupted run: inside an epoch,
the epoch's batches are rebuilt from the RNG state the epoch started with and the batches
already done are skipped. Checkpoints hold tensors and plain Python values only and are read
with ``torch.load(weights_only=True)``, which executes no pickled code. A file that cannot be read
back as a checkpoint (cut short, overwritten, another file) raises :class:`DamagedFile`, naming it.
Loading does not notice a changed byte among the tensors: a caller that must know a file is the
one written keeps its checksum (``experiments.records`` does, in a finished run's record).

Devices, processes and precision come from an engine (:mod:`bam_pyro.distributed`): by default
one process, as above; on Lightning Fabric (``engine_for(DeviceSettings(...))``) the loop also runs
on GPUs, in mixed precision and data-parallel over several processes, and keeps all of the above:

- every process builds the same epoch of batches and trains on its share of it (batch ``i`` goes to
  process ``i % world_size``; a last incomplete round is filled from the epoch's first batches,
  as ``DistributedSampler`` pads): each step's global batch is ``world_size`` batches;
- the batches are built from a random stream all processes share, while the noise and dropout of
  each process come from its own stream, derived from the seed and the rank once the model is
  initialized (``DDP`` starts every process from process 0's parameters);
- the epoch's mean loss and the evaluation's metrics are averaged over the processes; early
  stopping and checkpoints by time are decided on process 0 and broadcast;
- one checkpoint, written by process 0 (Fabric's save), holds every process's random state and
  is read by every process onto its device (tensors are read to the CPU first: a GPU run resumes
  on a CPU). Resuming needs as many processes as wrote it.

On a GPU, bit-for-bit resume holds only where the kernels are deterministic: some are not by
default (atomic adds in scatter and ``index_add``, which edge attention's softmax over
neighbourhoods uses; some cuDNN kernels). ``torch.use_deterministic_algorithms(True)`` (with
``CUBLAS_WORKSPACE_CONFIG=:4096:8``) makes them so or raises naming the operation; a run's record
says whether it was on (:meth:`bam_pyro.distributed.LocalEngine.describe`).
"""

from __future__ import annotations

import copy
import errno
import math
import os
import random
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import numpy as np
import pyro
import torch
from tqdm.auto import tqdm

try:
    import resource
except ImportError:  # not on Windows
    resource = None

from .distributed import ElboLoss, Engine, LocalEngine
from .elbo import AttentionMeanFieldELBO
from .model import BamModel
from .validation import is_number

Batch = tuple[tuple, dict]  # (positional args, keyword args) of one model call


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch and Pyro."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    pyro.set_rng_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's and torch's global RNG states, as tensors and plain values (NumPy's
    key array becomes a tensor, so that ``torch.load(weights_only=True)`` reads it back), and
    every CUDA device's once CUDA is in use (dropout and attention noise drawn there)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"] = {"key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                            "pos": int(numpy_state["state"]["pos"])}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def stream_seed(seed: int, index: int) -> int:
    """The seed of random stream ``index`` of a run seeded with ``seed`` (a process's own stream in
    training, one item's draws in :func:`seeded`): independent streams (NumPy's ``SeedSequence``),
    none of them another seed's stream."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The block with Python, NumPy, torch and Pyro seeded by ``seed``, the caller's RNG states (CUDA's
    too) restored afterwards: draws reproduced from their seed alone, whatever process makes them and
    whatever ran before, which leave the rest of a run's randomness as it was."""
    state = pyro.util.get_rng_state()
    try:
        with torch.random.fork_rng():
            pyro.set_rng_seed(seed)
            yield
    finally:
        pyro.util.set_rng_state(state)


T = TypeVar("T")


def share_seeded(work: Callable[[int], T], seeds: Sequence[int], engine: Optional[Engine] = None) -> list[T]:
    """``[work(i) for i in range(len(seeds))]``, item ``i`` run under :func:`seeded` ``(seeds[i])``,
    split over the processes of ``engine`` (default: this one; :meth:`LocalEngine.share`). An item's
    randomness then depends on its seed alone, so the gathered list is what one process draws."""

    def item(index: int) -> T:
        with seeded(seeds[index]):
            return work(index)

    return (engine or LocalEngine()).share(item, len(seeds))


def shard(items: Iterable[Any], rank: int, world_size: int) -> Iterator[Any]:
    """Process ``rank``'s items of ``items``: item ``i`` for each ``i % world_size == rank``, and a
    last incomplete round filled from the first items (as ``DistributedSampler`` pads), so that every
    process gets the same number, ``ceil(len / world_size)``."""
    head: list[Any] = []  # the first world_size - 1 items, which fill the last round
    count = 0
    for count, item in enumerate(items, 1):
        if len(head) < world_size - 1:
            head.append(item)
        if (count - 1) % world_size == rank:
            yield item
    rounded = -(-count // world_size) * world_size
    for position in range(count, rounded):
        if position % world_size == rank:
            yield head[(position - count) % len(head)]


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {"key": numpy_state["state"]["key"].numpy().astype(np.uint32),
                            "pos": numpy_state["state"]["pos"]}
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():  # resumed without CUDA, its streams go unused
        torch.cuda.set_rng_state_all(state["cuda"])


def same_setting(a: Any, b: Any) -> bool:
    """Whether two values of a setting are the same: of one type (``True`` is not ``1``), except
    that an int and a float may be equal numbers; NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b) or (is_number(a) and is_number(b) and float(a) == float(b))


class Diverged(FloatingPointError, ValueError):
    """Training produced a non-finite loss or validation metric: the run cannot go on with these
    settings. One line naming the step or epoch; the last checkpoint written before it is kept."""


class DamagedFile(ValueError):
    """A file that cannot be read back as it was written: one line naming it, the reason and what
    to do (``advice``: delete it to start that training again, or restore it from a copy)."""

    def __init__(self, path: os.PathLike, reason: str,
                 advice: str = "delete it to start that training again, or restore it from a copy") -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path} is damaged ({reason}): {advice}")


class WriteFailed(OSError):
    """A file that could not be written (a full disk, a file-size limit, a quota): one line naming
    the folder and the reason. The partial file is gone by the time it is raised."""

    def __init__(self, folder: os.PathLike, error: BaseException) -> None:
        self.folder = Path(folder)
        reason = error.strerror if isinstance(error, OSError) and error.strerror else _write_failure(self.folder, error)
        super().__init__(f"cannot write in {folder}: {reason.lower()}")


def _write_failure(folder: Path, error: BaseException) -> str:
    """Why a write that gave no errno failed: torch's writer reports a full disk or a file-size
    limit only as an "unexpected pos" of its zip stream. Asked while the partial file still
    takes its room."""
    try:
        if shutil.disk_usage(folder).free < 1 << 20:
            return os.strerror(errno.ENOSPC)
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource is not None else None
    if limit not in (None, getattr(resource, "RLIM_INFINITY", None)):
        return f"{os.strerror(errno.EFBIG)} (this process may write files of at most {limit} bytes)"
    return _first_sentence(error)


def _is_write_error(error: BaseException) -> bool:
    """An error of writing a file: the system's, or torch's zip writer's (which carries no errno)."""
    return isinstance(error, OSError) or (isinstance(error, RuntimeError) and any(
        mark in str(error) for mark in ("inline_container", "PytorchStreamWriter", "file write failed", "iostream error")))


def _first_sentence(error: BaseException) -> str:
    """An error's message cut to one line (torch's zip errors run on for several sentences)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(". ")[0].rstrip(".")


def metadata_differences(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """``name=saved (this run: value)`` for every entry that differs between two flat dicts
    (:func:`same_setting`); an entry one side lacks differs too (a checkpoint written before a
    setting existed may have had any value of it)."""
    names = sorted(set(saved) | set(expected))
    return [f"{n}={saved.get(n, 'absent')!r} (this run: {expected.get(n, 'absent')!r})" for n in names
            if n not in saved or n not in expected or not same_setting(saved[n], expected[n])]


@dataclass
class EarlyStopping:
    """Stop after ``patience`` epochs without improvement of any monitored metric.

    ``monitors`` maps metric names to ``"min"`` or ``"max"``. As in the GAT reference, an epoch
    that improves (or ties) *any* metric resets the patience; one that improves *all* of them
    becomes the best epoch, whose parameters are kept.

    ``start_epoch``: epochs before it are neither kept nor counted (a warm-up phase that trains
    another objective, e.g. va-relaxed's Jensen warm start in translation, is no candidate model).
    """

    monitors: dict[str, str]
    patience: int = 100
    start_epoch: int = field(default=0, kw_only=True)
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
        if self.start_epoch < 0:
            raise ValueError(f"start_epoch must be >= 0, got {self.start_epoch}")

    def _improves(self, name: str, value: float) -> bool:
        if name not in self.best:
            return True
        return value <= self.best[name] if self.monitors[name] == "min" else value >= self.best[name]

    def update(self, metrics: dict[str, float], epoch: int, model: torch.nn.Module) -> bool:
        """Record an epoch's validation metrics; True when training should stop."""
        missing = set(self.monitors) - set(metrics)
        if missing:
            raise KeyError(f"evaluation did not return the monitored metrics {sorted(missing)}")
        undefined = sorted(name for name in self.monitors if math.isnan(metrics[name]))
        if undefined:  # NaN compares false with everything: kept as the best, it would never be beaten
            raise Diverged(f"epoch {epoch}: the monitored {', '.join(undefined)} is NaN (the model diverged?)")
        if epoch < self.start_epoch:
            return False
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
        """The running record, the monitors (so a checkpoint says which way each metric improves)
        and the rule (patience, start epoch: what ``experiments.status`` reads to tell the epochs left)."""
        keys = ("monitors", "patience", "start_epoch", "best", "best_epoch", "best_state", "waited")
        return {k: getattr(self, k) for k in keys}

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
    monitors: Optional[dict[str, str]] = None  # early stopping's metrics and their directions


class SVITrainer:
    """Trains a :class:`~bam_pyro.model.BamModel` with its guide by SVI.

    ``checkpoint``: file to save the full training state to every ``checkpoint_every`` epochs,
    between steps once ``checkpoint_seconds`` have passed since the last save (None: by epoch
    only), and at the end; if it exists when :meth:`fit` starts, the run resumes from it.
    ``metadata``: a flat dict saved with the checkpoint (e.g. the run's settings); a checkpoint
    whose metadata differs is refused, naming the entries, rather than resumed.
    ``elbo``: any object with ``differentiable_loss(model, guide, *args, **kwargs)``.
    ``scheduler``: a learning-rate scheduler stepped after every optimizer step (saved with it).
    ``engine``: where it trains (:func:`bam_pyro.distributed.engine_for`; default: this process,
    the model where it is). Under Fabric the model is moved to its device when training starts.
    """

    def __init__(
        self,
        model: BamModel,
        guide: Callable,
        optimizer: torch.optim.Optimizer,
        elbo: Optional[Any] = None,
        checkpoint: Optional[os.PathLike] = None,
        checkpoint_every: int = 50,
        grad_clip: Optional[float] = None,
        checkpoint_seconds: Optional[float] = None,
        metadata: Optional[dict[str, Any]] = None,
        scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
        engine: Optional[Engine] = None,
    ) -> None:
        self.model, self.guide, self.optimizer, self.scheduler = model, guide, optimizer, scheduler
        self.elbo = elbo or AttentionMeanFieldELBO()
        self.engine = engine or LocalEngine()
        self.checkpoint = Path(checkpoint) if checkpoint else None
        self.checkpoint_every = checkpoint_every
        self.checkpoint_seconds = checkpoint_seconds
        self.metadata = dict(metadata or {})
        #: what the current ``fit`` call was asked for (saved with checkpoints, for progress reports)
        self.plan: dict[str, Optional[int]] = {"max_epochs": None, "steps_per_epoch": None}
        self.grad_clip = grad_clip
        #: optimizer steps taken so far, the ``t`` of the KL annealing (saved with checkpoints)
        self.global_step = 0
        self.epoch = 0
        self.history: list[dict[str, float]] = []
        self.seconds = 0.0  # wall time of the run so far, carried over by a checkpoint
        # progress inside the current epoch: steps done, their losses, the RNG state it began with
        self.step_in_epoch = 0
        self.epoch_losses: list[float] = []
        self.epoch_rng: Optional[dict[str, Any]] = None
        #: several processes: the random stream the batches are built from, the same on every process
        self.batch_rng: Optional[dict[str, Any]] = None
        self.result: Optional[FitResult] = None
        self._last_save = time.perf_counter()
        self._loss: Optional[torch.nn.Module] = None  # the ELBO as a module, as the engine set it up
        self._optimizer: Optional[torch.optim.Optimizer] = None

    def _set_up(self, first_batch: Callable[[], Optional[Batch]]) -> None:
        """Hand the loss and the optimizer to the engine, once. Lazy parameters must exist before an
        engine wraps or moves the model: they are made by a pass of the model on ``first_batch()``
        (without gradients; it draws from the random streams as a step would)."""
        if self._loss is not None:
            return
        if self.engine.wraps_model and any(torch.nn.parameter.is_lazy(p) for p in self.model.parameters()):
            batch = first_batch()
            if batch is None:
                raise ValueError("the model has uninitialized (lazy) parameters and there is no batch to make them with")
            with torch.no_grad():
                self.model.model(*batch[0], **batch[1])
        self._loss, self._optimizer = self.engine.setup(ElboLoss(self.model, self.guide, self.elbo), self.optimizer)

    def step(self, *args: Any, **kwargs: Any) -> float:
        """One SVI step on one batch; returns the loss (negative ELBO under the objective)."""
        self._set_up(lambda: (args, kwargs))
        self.model.train()
        args, kwargs = self.engine.to_device((args, kwargs))
        loss = self._loss(*args, step=self.global_step, **kwargs)
        if not torch.isfinite(loss):
            raise Diverged(
                f"non-finite loss {loss.item()} at step {self.global_step}; check the inputs "
                "and the hyperparameters (k, sigma, beta, alpha, learning rate)"
            )
        self._optimizer.zero_grad(set_to_none=True)
        self.engine.backward(loss)
        if self.grad_clip is not None:
            self.engine.clip_gradients(self._loss, self._optimizer, self.grad_clip)
        self._optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.global_step += 1
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
        many batches), a second progress bar follows the steps of the current epoch.

        ``batches()`` may shuffle with the global RNG (as a ``DataLoader`` does) or with its own
        generator seeded by the epoch: a resume inside an epoch replays it from the epoch's start.
        On several processes every process calls ``batches()`` and trains on its share (module doc)."""
        engine = self.engine
        self._set_up(lambda: next(iter(batches()), None))
        if self.checkpoint is not None and self.checkpoint.exists():
            self.load(self.checkpoint, early_stopping)
        elif engine.world_size > 1:
            self.batch_rng = engine.broadcast(rng_state())
            seed_everything(stream_seed(engine.broadcast(torch.initial_seed()), engine.rank))
        if steps_per_epoch:
            steps_per_epoch = -(-steps_per_epoch // engine.world_size)  # this process's share
        self.plan = {"max_epochs": max_epochs, "steps_per_epoch": steps_per_epoch}
        progress = progress and engine.is_global_zero
        start = time.perf_counter() - self.seconds  # the run's clock, a resumed run's included
        self._last_save = time.perf_counter()
        stopped = early_stopping is not None and early_stopping.waited >= early_stopping.patience
        bar = tqdm(total=max_epochs, initial=self.epoch, desc=description, disable=not progress, dynamic_ncols=True, leave=False)
        while self.epoch < max_epochs and not stopped:
            epoch_batches = self._epoch_batches(batches)
            if progress and steps_per_epoch:
                epoch_batches = tqdm(epoch_batches, total=steps_per_epoch, initial=self.step_in_epoch,
                                     desc=f"epoch {self.epoch + 1}", dynamic_ncols=True, leave=False)
            for args, kwargs in epoch_batches:
                self.epoch_losses.append(self.step(*args, **kwargs))
                self.step_in_epoch += 1
                if self._time_to_save():
                    self.seconds = time.perf_counter() - start
                    self.save(self.checkpoint, early_stopping)
            self.model.eval()
            with torch.no_grad():
                metrics = engine.mean({name: float(value) for name, value in evaluate().items()})
            record = {"epoch": self.epoch, **engine.mean({"loss": float(np.mean(self.epoch_losses))}), **metrics}
            self.history.append(record)
            if early_stopping is not None:
                stopped = engine.broadcast(early_stopping.update(metrics, self.epoch, self.model))
            self.epoch += 1
            self.step_in_epoch, self.epoch_losses, self.epoch_rng = 0, [], None
            self.seconds = time.perf_counter() - start
            bar.set_postfix({k: f"{v:.4g}" for k, v in record.items() if k != "epoch"}, refresh=False)
            bar.update(1)  # draws the bar with this epoch's figures
            if self.checkpoint is not None and (self.epoch % self.checkpoint_every == 0 or stopped or self._time_to_save()):
                self.save(self.checkpoint, early_stopping)
        bar.close()
        self.seconds = time.perf_counter() - start
        if self.checkpoint is not None:
            self.save(self.checkpoint, early_stopping)
        best_epoch = self.epoch - 1
        if early_stopping is not None and early_stopping.best_state is not None:
            self.model.load_state_dict(early_stopping.best_state)
            best_epoch = early_stopping.best_epoch
        monitors = early_stopping.monitors if early_stopping is not None else None
        self.result = FitResult(self.epoch, best_epoch, stopped, self.seconds, self.history, monitors)
        return self.result

    def _epoch_batches(self, batches: Callable[[], Iterable[Batch]]) -> Iterator[Batch]:
        """This process's batches of the current epoch; after a resume inside the epoch, those not yet done."""
        if self.engine.world_size > 1:
            if self.step_in_epoch == 0:
                self.epoch_rng = self.batch_rng
            self.batch_rng = self.epoch_rng
            remaining = shard(self._from_batch_stream(batches), self.engine.rank, self.engine.world_size)
            return self._skip_done(remaining)
        if self.step_in_epoch == 0:
            self.epoch_rng = rng_state()
            return iter(batches())
        resumed_rng = rng_state()
        set_rng_state(self.epoch_rng)  # build the epoch's batches as they were first built
        remaining = self._skip_done(iter(batches()))
        set_rng_state(resumed_rng)
        return remaining

    def _skip_done(self, remaining: Iterator[Batch]) -> Iterator[Batch]:
        for done in range(self.step_in_epoch):
            if next(remaining, None) is None:
                raise ValueError(f"the checkpoint was written after step {self.step_in_epoch} of epoch "
                                 f"{self.epoch + 1}, but the epoch has only {done} batches now")
        return remaining

    def _from_batch_stream(self, batches: Callable[[], Iterable[Batch]]) -> Iterator[Batch]:
        """``batches()``, every draw of it from the shared stream :attr:`batch_rng`."""
        iterator = self._on_batch_stream(lambda: iter(batches()))
        while True:
            try:
                batch = self._on_batch_stream(lambda: next(iterator))
            except StopIteration:
                return
            yield batch

    def _on_batch_stream(self, draw: Callable[[], Any]) -> Any:
        own = rng_state()
        set_rng_state(self.batch_rng)
        try:
            return draw()
        finally:
            self.batch_rng = rng_state()
            set_rng_state(own)

    def _time_to_save(self) -> bool:
        """Whether a checkpoint by time is due, as process 0's clock says."""
        if self.checkpoint is None or self.checkpoint_seconds is None:
            return False
        return self.engine.broadcast(time.perf_counter() - self._last_save >= self.checkpoint_seconds)

    def state_dict(self, early_stopping: Optional[EarlyStopping] = None) -> dict[str, Any]:
        """The training state; on several processes every process must call it (it gathers their
        random states and epoch losses)."""
        processes = self.engine.gather({"rng": rng_state(), "epoch_losses": self.epoch_losses})
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "epoch_losses": self.epoch_losses,
            "epoch_rng": self.epoch_rng,
            "history": self.history,
            "seconds": self.seconds,
            "early_stopping": early_stopping.state_dict() if early_stopping else None,
            "rng": processes[0]["rng"],
            "metadata": self.metadata,
            "plan": self.plan,
        }
        if self.engine.world_size > 1:
            state.update(processes=processes, batch_rng=self.batch_rng)
        return state

    def save(self, path: os.PathLike, early_stopping: Optional[EarlyStopping] = None) -> None:
        """Write the full training state atomically (a crash mid-write keeps the old file); on several
        processes every process calls it and process 0 writes. A write that fails (a full disk) or is
        interrupted leaves no partial file; the failure is :class:`WriteFailed`, naming the folder."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        state = self.state_dict(early_stopping)
        if self.engine.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.engine.save(tmp, state)
            if self.engine.is_global_zero:
                os.replace(tmp, path)
        except BaseException as error:
            failed = WriteFailed(path.parent, error) if _is_write_error(error) else None
            if self.engine.is_global_zero:
                tmp.unlink(missing_ok=True)
            if failed is None or isinstance(error, WriteFailed):
                raise
            raise failed from None
        self._last_save = time.perf_counter()

    def load(self, path: os.PathLike, early_stopping: Optional[EarlyStopping] = None) -> None:
        """Continue from the checkpoint ``path``, read to the CPU and loaded onto the model's device."""
        state = read_checkpoint(path)
        require_same_metadata(path, state["metadata"], self.metadata)
        processes = state.get("processes", [{"rng": state["rng"], "epoch_losses": state["epoch_losses"]}])
        if len(processes) != self.engine.world_size:
            raise ValueError(f"{path} was written by {len(processes)} training process(es), this run has "
                             f"{self.engine.world_size}: resume it with as many (each one's random stream is in it)")
        self.global_step = saved_global_step(state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.history, self.seconds = state["epoch"], state["history"], state["seconds"]
        self.step_in_epoch, self.epoch_rng = state["step_in_epoch"], state["epoch_rng"]
        self.batch_rng = state.get("batch_rng")
        own = processes[self.engine.rank]
        self.epoch_losses = own["epoch_losses"]
        if early_stopping is not None and state["early_stopping"] is not None:
            early_stopping.load_state_dict(state["early_stopping"])
        set_rng_state(own["rng"])


#: what every checkpoint of :meth:`SVITrainer.save` holds, whatever version wrote it
CHECKPOINT_KEYS = ("model", "optimizer", "epoch", "history", "metadata")


def read_checkpoint(path: os.PathLike, mmap: bool = False, map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint written by :meth:`SVITrainer.save`, read without executing pickled code;
    :class:`DamagedFile` if it cannot be read back as one. ``mmap``: map the tensors instead of
    reading them (cheap: for a look at the plain values). ``map_location``: where its tensors go
    (``torch.load``'s; by default the CPU, wherever they were saved)."""
    if os.path.getsize(path) == 0:
        raise DamagedFile(path, "an empty file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except (FileNotFoundError, PermissionError, IsADirectoryError, MemoryError):
        raise
    except Exception as error:  # torch.load's errors on a broken file: RuntimeError, EOFError, UnpicklingError, OSError...
        raise DamagedFile(path, f"not a readable checkpoint: {_first_sentence(error)}") from None
    missing = [key for key in CHECKPOINT_KEYS if key not in state] if isinstance(state, dict) else list(CHECKPOINT_KEYS)
    if missing:
        raise DamagedFile(path, f"not a checkpoint of SVITrainer: no {', '.join(missing)}")
    return state


def saved_global_step(state: dict[str, Any]) -> int:
    """The optimizer steps a checkpoint's run had taken: its ``global_step``, or, in a checkpoint
    written while the model kept the step as a buffer, that buffer (``state["model"]["step"]``)."""
    if "global_step" in state:
        return state["global_step"]
    return int(state["model"]["step"])


def require_same_metadata(path: os.PathLike, saved: dict[str, Any], expected: dict[str, Any]) -> None:
    """Refuse (``ValueError``, naming the entries) to resume from the checkpoint ``path`` written
    with other metadata (settings) than ``expected``."""
    differing = metadata_differences(saved, expected)
    if differing:
        raise ValueError(f"{path} holds an unfinished run with other settings: {'; '.join(differing)}. "
                         "Delete it to start again, or choose another output folder.")
