"""Where :class:`~bam_pyro.training.SVITrainer` runs: one process as it is, or on Lightning Fabric.

:class:`DeviceSettings` says which devices, how many processes, which strategy and which precision.
:func:`engine_for` turns them into an engine the training loop calls for everything that depends on
them (moving batches, backward, clipping, reducing, broadcasting, saving):

- :class:`LocalEngine`: one process, the model where it is, full precision; what the loop did
  before Fabric, step for step, and all that runs without the ``lightning`` extra;
- :class:`FabricEngine`: ``lightning.fabric.Fabric`` with those settings. Fabric detects how it
  was launched: a plain process (Fabric starts the other processes itself when ``devices`` > 1),
  ``torchrun``, or SLURM's ``srun``; ``devices`` and ``num_nodes`` must then match the launcher's
  processes per node and nodes (``"auto"`` devices takes the launcher's count).

The loss is a module (:class:`ElboLoss`) whose forward returns
``elbo.differentiable_loss(model, guide, ...)``: Fabric wraps it (DDP: gradients averaged across
processes), and its forward runs under the precision's autocast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, TypeVar, Union, get_args

import torch
from torch import Tensor, nn

from . import optional
from .validation import require, whole_number

Accelerator = Literal["auto", "cpu", "cuda", "mps"]
Strategy = Literal["auto", "ddp", "fsdp"]
Precision = Literal["32-true", "bf16-mixed", "16-mixed"]
ACCELERATORS: tuple[str, ...] = get_args(Accelerator)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
PRECISIONS: tuple[str, ...] = get_args(Precision)
T = TypeVar("T")


def launched_processes_per_node() -> Optional[int]:
    """The processes per node an outside launcher started (``torchrun``: ``LOCAL_WORLD_SIZE``;
    SLURM: ``SLURM_NTASKS_PER_NODE``), None in a plain process."""
    for variable in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    return None


@dataclass(frozen=True)
class DeviceSettings:
    """Devices, processes, strategy and precision of a training run (Lightning Fabric's names).

    ``devices``: devices (processes) per node, or ``"auto"``: the processes an outside launcher
    (torchrun, SLURM) started per node, else one. The defaults train in one process, on the GPU
    if there is one, in float32: on a machine without one, exactly as without Fabric.

    ``deterministic``: torch's deterministic algorithms for the whole process (see
    :func:`use_deterministic_algorithms`), so that a run resumed on a GPU takes the steps it would
    have taken; without it, GPU kernels that add with atomics (scatters, embedding gradients) or that
    cuDNN picks by timing may change the last bits from run to run. On the CPU the loop is exact
    either way.
    """

    accelerator: Accelerator = "auto"
    devices: Union[int, Literal["auto"]] = "auto"
    num_nodes: int = 1
    strategy: Strategy = "auto"
    precision: Precision = "32-true"
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("accelerator", ACCELERATORS), ("strategy", STRATEGIES), ("precision", PRECISIONS)):
            require(getattr(self, name) in allowed, name, getattr(self, name), f"one of {', '.join(allowed)}")
        if self.devices != "auto":
            whole_number("devices", self.devices, minimum=1)
        whole_number("num_nodes", self.num_nodes, minimum=1)

    @property
    def devices_per_node(self) -> int:
        return (launched_processes_per_node() or 1) if self.devices == "auto" else self.devices

    @property
    def resolved_accelerator(self) -> str:
        if self.accelerator != "auto":
            return self.accelerator
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"

    @property
    def local(self) -> bool:
        """Whether these settings describe what :class:`LocalEngine` does: one CPU process, float32."""
        return (self.resolved_accelerator == "cpu" and self.devices_per_node * self.num_nodes == 1
                and self.strategy == "auto" and self.precision == "32-true")


class ElboLoss(nn.Module):
    """``forward(*args, **kwargs)`` = ``elbo.differentiable_loss(model.model, guide, *args, **kwargs)``:
    the SVI loss as a module, for a data-parallel wrapper to run (and average the gradients of)."""

    def __init__(self, model: nn.Module, guide: Callable, elbo: Any) -> None:
        super().__init__()
        self.model, self.guide, self.elbo = model, guide, elbo

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.elbo.differentiable_loss(self.model.model, self.guide, *args, **kwargs)


class LocalEngine:
    """One process, the model where it is, float32: every collective is the identity."""

    rank = 0
    world_size = 1
    is_global_zero = True
    #: whether :meth:`setup` wraps or moves the model (lazy parameters must exist before it)
    wraps_model = False
    #: where the model trains (a task puts its evaluation data there)
    device = torch.device("cpu")

    def setup(self, loss: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        return loss, optimizer

    def to_device(self, value: Any) -> Any:
        return value

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        """Scale the gradients of the optimizer's parameters to a total norm of at most ``max_norm``."""
        torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], max_norm)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Each value averaged over the processes."""
        return values

    def broadcast(self, value: Any) -> Any:
        """Process 0's ``value``, on every process."""
        return value

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value``, in rank order, on every process."""
        return [value]

    def share(self, work: Callable[[int], T], count: int) -> list[T]:
        """``[work(i) for i in range(count)]`` on every process, each process computing only its
        share (item ``i`` on process ``i % world_size``), the results gathered in item order: work
        that several processes split rather than repeat (posterior draws of an evaluation set).
        ``work`` must run no collective (the shares may differ by an item) and should return small
        CPU values (they travel pickled). Results equal one process's only where ``work(i)``
        depends on ``i`` alone (its randomness seeded by ``i``, not drawn from the process's stream)."""
        own = [work(i) for i in range(self.rank, count, self.world_size)]
        shares = self.gather(own)
        return [shares[i % self.world_size][i // self.world_size] for i in range(count)]

    def save(self, path: os.PathLike, state: dict[str, Any]) -> None:
        """Write ``state`` to ``path`` (from process 0 only, once every process has called this)."""
        torch.save(state, path)

    def describe(self) -> dict[str, Any]:
        """What ran: for the run's record."""
        return {"accelerator": "cpu", "devices": ["cpu"], "processes": 1, "num_nodes": 1, "strategy": "single process",
                "precision": "32-true", "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}


class FabricEngine(LocalEngine):
    """Lightning Fabric with :class:`DeviceSettings`; :meth:`launch` starts its processes (if it
    starts them) and the process group. Several processes run DDP (``"auto"`` too), with
    ``find_unused_parameters``: some variants leave parameters out of some steps (va-relaxed's
    inference network in its warm start)."""

    wraps_model = True

    def __init__(self, settings: DeviceSettings) -> None:
        fabric = optional.require("lightning.fabric", "training on devices other than one CPU process in float32")
        if settings.strategy == "fsdp":
            # SVITrainer reads and writes full state dicts (checkpoints, early stopping's kept epoch)
            # and tasks evaluate the unwrapped network: neither holds under FSDP's sharded parameters
            raise ValueError("strategy 'fsdp' is not supported by SVITrainer (it keeps full state dicts and tasks "
                             "evaluate the unwrapped network): use 'ddp', which fits every model here on one device")
        strategy: Any = settings.strategy
        if strategy == "ddp" or (strategy == "auto" and settings.devices_per_node * settings.num_nodes > 1):
            strategy = fabric.strategies.DDPStrategy(find_unused_parameters=True)
        self.settings = settings
        try:
            self.fabric = fabric.Fabric(accelerator=settings.accelerator, devices=settings.devices_per_node,
                                        num_nodes=settings.num_nodes, strategy=strategy, precision=settings.precision)
        except (RuntimeError, ValueError) as error:  # e.g. no such accelerator here: Fabric's reason, one line
            raise ValueError(str(error).strip().splitlines()[0]) from None

    def launch(self) -> "FabricEngine":
        self.fabric.launch()
        return self

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.fabric.global_rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.fabric.world_size

    @property
    def is_global_zero(self) -> bool:  # type: ignore[override]
        return self.fabric.is_global_zero

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.fabric.device

    def setup(self, loss: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        return self.fabric.setup(loss, optimizer)

    def to_device(self, value: Any) -> Any:
        return self.fabric.to_device(value)

    def backward(self, loss: Tensor) -> None:
        self.fabric.backward(loss)

    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        self.fabric.clip_gradients(module, optimizer, max_norm=max_norm)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        if self.world_size == 1 or not values:
            return values
        names = sorted(values)
        packed = torch.tensor([values[n] for n in names], dtype=torch.float64, device=self.fabric.device)
        reduced = self.fabric.all_reduce(packed, reduce_op="mean")
        return {**values, **dict(zip(names, reduced.tolist()))}

    def broadcast(self, value: Any) -> Any:
        return self.fabric.broadcast(value, src=0) if self.world_size > 1 else value

    def gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        return [self.fabric.broadcast(value, src=rank) for rank in range(self.world_size)]

    def save(self, path: os.PathLike, state: dict[str, Any]) -> None:
        self.fabric.save(path, state)

    def describe(self) -> dict[str, Any]:
        devices = self.gather(str(self.fabric.device))
        return {"accelerator": self.settings.resolved_accelerator, "devices": devices, "processes": self.world_size,
                "num_nodes": self.settings.num_nodes, "strategy": type(self.fabric.strategy).__name__,
                "precision": getattr(self.fabric.strategy.precision, "precision", self.settings.precision),
                "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}


Engine = Union[LocalEngine, FabricEngine]


def use_deterministic_algorithms() -> None:
    """torch's deterministic algorithms from now on, in this process: an operation without a
    deterministic kernel raises, naming itself, rather than run; cuDNN stops choosing kernels by
    timing; cuBLAS gets the fixed workspace it needs (``CUBLAS_WORKSPACE_CONFIG``, unless set)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def engine_for(settings: Optional[DeviceSettings] = None) -> Engine:
    """The engine for ``settings`` (default: :class:`DeviceSettings`' defaults): :class:`LocalEngine`
    where they describe one CPU process in float32 and no launcher started several; else a launched
    :class:`FabricEngine`, which needs the ``lightning`` extra."""
    settings = settings or DeviceSettings()
    if settings.deterministic:
        use_deterministic_algorithms()
    if settings.local and launched_processes_per_node() in (None, 1):
        return LocalEngine()
    return FabricEngine(settings).launch()
