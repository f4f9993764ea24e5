"""Task declaration: a task's settings (:class:`RunSettings`), what its ``train`` gets besides them
(:class:`RunContext`), and the task itself (:class:`Task`), which the rest of the runner reads."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import pandas as pd
import torch

from bam_pyro import VARIANTS, BamConfig, ObjectiveConfig, validation
from bam_pyro.config import GammaShape, PriorScope, Reduction
from bam_pyro.distributed import Engine, LocalEngine
from bam_pyro.training import FitResult, SVITrainer
from experiments.records import CHECKPOINT


@dataclass(frozen=True)
class RunSettings:
    """What one run depends on. Tasks subclass it with their own fields and defaults; every field
    is a command-line option and a column of the run's record.

    The attention's settings are :class:`~bam_pyro.BamConfig`'s fields and the objective's are
    :class:`~bam_pyro.ObjectiveConfig`'s, flat, with the library's defaults; :attr:`attention` and
    :attr:`objective` build the library's configs from them (validated on construction).
    """

    variant: str = "soft"
    seed: int = 0
    k: float = field(default=BamConfig.k, metadata={"help": "Weibull shape of q (larger: less noise)"})
    sigma_q: float = field(default=BamConfig.sigma_q, metadata={"help": "Lognormal scale of q (the paper's sigma_2)"})
    sigma_p: float = field(default=BamConfig.sigma_p, metadata={"help": "Lognormal scale of the prior (sigma_1)"})
    mu_p: float = field(default=BamConfig.mu_p, metadata={"help": "location of the fixed Lognormal prior (lf)"})
    beta: float = field(default=BamConfig.beta, metadata={"help": "rate of the Gamma prior"})
    alpha: float = field(default=BamConfig.alpha, metadata={"help": "shape of the fixed Gamma prior (wf)"})
    gamma_shape: GammaShape = field(default=BamConfig.gamma_shape, metadata={
        "help": "contextual Gamma shape: Psi * beta (reference code) or Psi (paper's text)"})
    prior_scope: PriorScope = field(default=BamConfig.prior_scope, metadata={
        "help": "Psi is a softmax over each query's keys or over all keys (paper's text, reference code)"})
    d_mid: int = field(default=BamConfig.d_mid, metadata={"help": "hidden width of the contextual prior network"})
    detach_prior_keys: bool = field(default=BamConfig.detach_prior_keys, metadata={
        "help": "stop the KL's gradient at the contextual prior's input"})
    reduction: Reduction = field(default=ObjectiveConfig.reduction, metadata={
        "help": "mean (reference code: per-entry averages) or sum (the plain ELBO)"})
    kl_weight: float = field(default=ObjectiveConfig.kl_weight, metadata={
        "help": "weight of the KL term (the paper's att_kl)", "aliases": ("--att-kl",)})
    anneal_rate: Optional[float] = field(default=ObjectiveConfig.anneal_rate, metadata={
        "help": "rho of the KL annealing lambda_t = sigmoid(t * rho) (none: no annealing)", "aliases": ("--rho",)})

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a whole number >= 0, got {self.seed!r}")
        self.attention, self.objective  # noqa: B018  (validates both, naming the field)

    @property
    def attention(self) -> BamConfig:
        """The attention's config; a task-specific variant (not a BAM one) gets soft attention."""
        variant = self.variant if self.variant in VARIANTS else "soft"
        return BamConfig(variant, **{name: getattr(self, name) for name in ATTENTION_FIELDS})

    @property
    def objective(self) -> ObjectiveConfig:
        return ObjectiveConfig(self.reduction, self.kl_weight, self.anneal_rate)

    def row(self) -> dict[str, Any]:
        """Every setting by name: the record's ``settings``."""
        return dataclasses.asdict(self)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (the CPU for a model without any): where its inputs go."""
    return next(iter(model.parameters()), torch.empty(0)).device


#: the settings that are BamConfig's (all but its variant) and ObjectiveConfig's
ATTENTION_FIELDS = tuple(f.name for f in dataclasses.fields(BamConfig) if f.name != "variant")
OBJECTIVE_FIELDS = tuple(f.name for f in dataclasses.fields(ObjectiveConfig))
#: the settings in which variants compared by seed may differ (presets set them per variant);
#: all others are the training protocol, which paired variants must share
VARIANT_SETTINGS = ("variant", *ATTENTION_FIELDS, "kl_weight", "anneal_rate")


#: a setting that is a finite number > ``minimum`` (``>=`` unless ``strict``); None (unset) passes
positive = functools.partial(validation.positive, optional=True)


@dataclass
class RunContext:
    """What a task's ``train`` gets besides its settings and data.

    ``folder``: where the run's artifacts go (process 0: the run's own folder; the others of a
    several-process run: a scratch folder); ``checkpoint``: the run's checkpoint (default: in
    ``folder``); ``engine``: where its trainers train (default: this process)."""

    folder: Path
    settings: RunSettings
    progress: bool = True
    checkpoint_seconds: Optional[float] = 180.0
    description: str = "train"
    trainers: list[SVITrainer] = field(default_factory=list)
    engine: Engine = field(default_factory=LocalEngine)
    checkpoint: Optional[Path] = None

    def trainer(self, model, guide, optimizer, elbo=None, grad_clip: Optional[float] = None,
                checkpoint_every: int = 50, scheduler=None) -> SVITrainer:
        """An :class:`~bam_pyro.training.SVITrainer` on this run's engine that checkpoints into
        the run's folder by epoch and by time, and refuses a checkpoint written with other settings."""
        trainer = SVITrainer(model, guide, optimizer, elbo=elbo, checkpoint=self.checkpoint or self.folder / CHECKPOINT,
                             checkpoint_every=checkpoint_every, grad_clip=grad_clip,
                             checkpoint_seconds=self.checkpoint_seconds, metadata=self.settings.row(),
                             scheduler=scheduler, engine=self.engine)
        self.trainers.append(trainer)
        return trainer

    @property
    def device(self) -> torch.device:
        """Where the run's model trains: a task's evaluation inputs go there."""
        return self.engine.device

    def steps_per_process(self, batches: int) -> int:
        """The SVI steps each process takes in an epoch of ``batches`` batches (its share of them:
        what step-based schedules count)."""
        return -(-batches // self.engine.world_size)

    @property
    def fit_result(self) -> Optional[FitResult]:
        return self.trainers[-1].result if self.trainers else None


Metrics = Union[Sequence[str], Callable[[str], Sequence[str]]]


@dataclass(frozen=True)
class Task:
    """A task script, declared: see :mod:`experiments.runner`.

    ``train(settings, data, run)`` trains one run and returns its metrics (numbers by name);
    ``load(settings, data_root)`` reads the data of one panel (called once per panel value, with
    the settings of one of its runs: data may depend only on settings all its runs share).
    ``metrics``: the columns the tables show (a tuple, or a function of the panel value), the
    first one paired against soft and drawn. ``paper``: panel -> variant -> metric -> the paper's
    figure as the paper prints it (``"83.00"``, ``"42M"``), shown as ``paper <metric>``.
    ``tables``: replaces the default table (results -> named tables). ``after_sweep``: draws
    task figures from the results into the output folder. ``build(settings, data)``: the untrained
    model of a run, which :func:`load_trained` fills with a finished run's parameters.
    ``data_source``: where the data come from if not from a data root (e.g. an installed
    package): ``--data-root`` is then refused, rather than silently ignored.
    """

    name: str
    settings: type[RunSettings]
    panel: str
    panels: Sequence[str]
    load: Callable[[Any, Optional[str]], Any]
    train: Callable[[Any, Any, RunContext], Mapping[str, float]]
    metrics: Metrics
    presets: Callable[[str, str], Mapping[str, Any]] = lambda panel, variant: {}
    variants: Sequence[str] = tuple(VARIANTS)
    default_variants: Sequence[str] = ("soft", "wc")
    paper: Mapping[str, Mapping[str, Mapping[str, str]]] = field(default_factory=dict)
    tables: Optional[Callable[[pd.DataFrame], dict[str, pd.DataFrame]]] = None
    after_sweep: Optional[Callable[[pd.DataFrame, Path], None]] = None
    build: Optional[Callable[[Any, Any], torch.nn.Module]] = None
    description: str = ""
    data_source: Optional[str] = None

    def metrics_of(self, panel: str) -> list[str]:
        return list(self.metrics(panel) if callable(self.metrics) else self.metrics)

    def run_name(self, settings: RunSettings) -> str:
        return f"{getattr(settings, self.panel)}-{settings.variant}-seed{settings.seed}"

    def settings_for(self, panel: str, variant: str, seed: int, overrides: Mapping[str, Any]) -> RunSettings:
        """The field defaults, then the preset of (panel, variant), then the given ``overrides``
        (None: not given)."""
        values = {**self.presets(panel, variant), **{k: v for k, v in overrides.items() if v is not None}}
        return self.settings(variant=variant, seed=seed, **{self.panel: panel}, **values)
