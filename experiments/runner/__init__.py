"""The experiment runner: every task script is a :class:`Task` handed to :func:`run_cli`.

A task provides a settings dataclass (a :class:`RunSettings` subclass) with its presets, a data
loader, and a function that trains one run and returns its metrics. The runner does the rest, once
for every task:

- command-line options derived from the settings' fields (``--batch-size`` for ``batch_size``),
  so that a new setting is one line; a value given overrides the preset, which overrides the
  field's default;
- the sweep over panels (data sets or tasks) x seeds x variants, paired by seed;
- one record per run (:mod:`experiments.records`): finished runs are skipped, a finished or
  unfinished run asked for with other settings is refused by name, and an interrupted run resumes
  from its checkpoint (written by epoch and every ``--checkpoint-minutes``); the same command
  started in several processes shares the sweep out, each run trained by one of them;
- the tables (mean ± std per variant, the paired difference to soft with its confidence
  interval, the paper's figures beside ours) as Markdown and CSV, and the paired-runs picture;
- a finished run loaded back (:func:`load_trained`): its settings from the record, its kept
  epoch's parameters from the checkpoint, for analyses after the sweep;
- user errors (an invalid setting, a missing data file, a finished run with other settings, a
  damaged record or checkpoint, an output folder that cannot be written) end the command with one
  line and status 2, as argparse does, before any work; bugs keep their traceback. Every check
  that needs no data runs before the data load: the options, the output folder, the folder's
  records and the checkpoints of the runs asked for (finished: their checksums; unfinished:
  readable and of the same settings);
- devices, processes and precision (``--accelerator``, ``--devices``, ``--num-nodes``,
  ``--strategy``, ``--precision``: :class:`bam_pyro.distributed.DeviceSettings`, Lightning Fabric's
  names), which are not settings: a run may resume on other devices (a GPU run on a CPU), and its
  record says where it ran (``environment``). By default one process, on the GPU if there is one,
  in float32; on a machine without a GPU that is the runner as it was before Fabric, and needs no
  Lightning. The same command runs as one process, under ``torchrun`` and under SLURM's ``srun``
  (``--devices`` and ``--num-nodes`` as the launcher's processes per node and nodes; with
  ``--devices N`` and no launcher, Fabric starts the N processes). Several processes train each
  run together (data-parallel, :mod:`bam_pyro.training`): process 0 claims the run and writes its
  checkpoint, record and tables; the others write their artifacts to a scratch folder; the
  metrics a run returns are averaged over the processes (float ones; others are process 0's).

      python -m experiments.glue --task rte --accelerator cuda --precision bf16-mixed
      torchrun --standalone --nproc_per_node=4 -m experiments.glue --task rte --accelerator cuda
      srun --nodes=2 --ntasks-per-node=4 python -m experiments.glue --task rte --accelerator cuda --devices 4 --num-nodes 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import tempfile
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Sequence, Union

import pandas as pd
import torch

from analysis.plots import paired_runs
from analysis.tables import paired_difference, summarize
from bam_pyro import VARIANTS, BamConfig, ObjectiveConfig, validation
from bam_pyro.distributed import ACCELERATORS, PRECISIONS, STRATEGIES, DeviceSettings, Engine, LocalEngine, engine_for
from bam_pyro.validation import require
from bam_pyro.config import GammaShape, PriorScope, Reduction
from bam_pyro.training import FitResult, SVITrainer, metadata_differences

from experiments.records import (CHECKPOINT, RECORD, RunFolder, SettingsMismatch, new_record, require_writable_folder,
                      setting_differences)


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
    """A task script, declared: see the module docstring.

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


# --- command line ----------------------------------------------------------------------------


def _unwrap_optional(kind: Any) -> Any:
    if typing.get_origin(kind) is Union:
        rest = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return kind


def add_settings_options(parser: argparse.ArgumentParser, settings: type[RunSettings], skip: Sequence[str]) -> list[str]:
    """One option per settings field (``--name-with-dashes``, typed by the field's annotation;
    default None = keep the preset); returns the fields' names."""
    group = parser.add_argument_group("settings (default: the task's presets)")
    hints = typing.get_type_hints(settings)
    names = []
    for f in dataclasses.fields(settings):
        if f.name in skip:
            continue
        kind = _unwrap_optional(hints[f.name])
        flags = [f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", ())]
        options: dict[str, Any] = {"default": None, "dest": f.name, "help": f.metadata.get("help")}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            options["choices"] = typing.get_args(kind)
        elif kind in (int, float, str):
            options["type"] = kind
        else:
            raise TypeError(f"setting {settings.__name__}.{f.name} has type {kind}, which has no command-line form")
        group.add_argument(*flags, **options)
        names.append(f.name)
    return names


def whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``minimum`` (argparse names the option)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def devices_option(text: str) -> Union[int, str]:
    """An argparse ``type`` for ``--devices``: ``auto`` or a whole number >= 1."""
    return text if text == "auto" else whole_number(1)(text)


def build_parser(task: Task) -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{task.name}", description=task.description)
    parser.add_argument(f"--{task.panel.replace('_', '-')}", dest="panels", nargs="+", choices=list(task.panels),
                        default=[task.panels[0]], metavar=task.panel.upper(), help=f"one or more of {', '.join(task.panels)}")
    parser.add_argument("--variant", nargs="+", choices=list(task.variants), default=list(task.default_variants))
    parser.add_argument("--seeds", nargs="+", type=whole_number(0), default=[0])
    parser.add_argument("--out", default=f"runs/{task.name}", help="output folder (runs/, results.csv, tables, figures)")
    parser.add_argument("--data-root", default=None, help=f"not read: the data come from {task.data_source}" if task.data_source
                        else "data root (default: $BAM_DATA, ../shared/data, or a download cache)")
    parser.add_argument("--threads", type=whole_number(1), default=min(2, os.cpu_count() or 1), help="torch CPU threads")
    parser.add_argument("--checkpoint-minutes", type=float, default=3.0,
                        help="also checkpoint inside an epoch once this many minutes have passed (0: after every step)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    devices = parser.add_argument_group("devices (Lightning Fabric's; not settings: a run may resume on others)")
    devices.add_argument("--accelerator", choices=ACCELERATORS, default=DeviceSettings.accelerator,
                         help="auto: a GPU if there is one, else the CPU")
    devices.add_argument("--devices", type=devices_option, default=DeviceSettings.devices,
                         help="devices (processes) per node, or auto: the launcher's processes per node (torchrun, srun), else 1")
    devices.add_argument("--num-nodes", type=whole_number(1), default=DeviceSettings.num_nodes, help="machines")
    devices.add_argument("--strategy", choices=STRATEGIES, default=DeviceSettings.strategy,
                         help="ddp: data-parallel over the processes (fsdp is refused: see bam_pyro.distributed)")
    devices.add_argument("--precision", choices=PRECISIONS, default=DeviceSettings.precision,
                         help="bf16-mixed / 16-mixed: autocast around the SVI step, float32 parameters")
    devices.add_argument("--deterministic", action="store_true",
                         help="torch's deterministic algorithms (exact resume on a GPU; an op without one stops the run, naming it)")
    names = add_settings_options(parser, task.settings, skip=(task.panel, "variant", "seed"))
    return parser, names


def run_cli(task: Task, argv: Optional[Sequence[str]] = None) -> dict[str, pd.DataFrame]:
    """Parse the command line, check every run's settings and data, run the sweep, write and print
    the tables. User errors end the command with one line and status 2."""
    parser, names = build_parser(task)
    args = parser.parse_args(argv)
    try:
        if args.checkpoint_minutes < 0:
            raise ValueError(f"--checkpoint-minutes must be >= 0, got {args.checkpoint_minutes}")
        if args.data_root is not None and task.data_source:
            raise ValueError(f"--data-root is not read by {task.name}: its data come from {task.data_source}")
        require_writable_folder(args.out)
        engine = engine_for(DeviceSettings(args.accelerator, args.devices, args.num_nodes, args.strategy, args.precision,
                                           args.deterministic))
        plan = plan_sweep(task, args.panels, args.variant, args.seeds, {n: getattr(args, n) for n in names}, RunFolder(args.out))
    except (ValueError, TypeError, ImportError) as error:
        parser.exit(2, f"{parser.prog}: error: {str(error).strip().splitlines()[0]}\n")
    torch.set_num_threads(args.threads)
    return run_sweep(task, engine.broadcast(plan), RunFolder(args.out), args, parser, engine)


def require_agreement(results: pd.DataFrame, task: Task, settings: Sequence[str], advice: str) -> None:
    """Runs of a panel and variant share every setting but the seed, and the variants of a panel
    all but their attention's (:data:`VARIANT_SETTINGS`): else their table would pool or pair runs
    of different experiments. Raises ``ValueError`` naming the settings, and ``advice``."""
    protocol = [s for s in settings if s not in VARIANT_SETTINGS]
    for by, names, reason in (([task.panel, "variant"], settings, "they are not seeds of one experiment"),
                              ([task.panel], protocol, "variants are paired by seed only if trained alike")):
        for key, runs in results.groupby(by, sort=False):
            mixed = {n: sorted(map(str, runs[n].unique())) for n in names if runs[n].astype(str).nunique() > 1}
            if mixed:
                raise ValueError(f"the {'/'.join(map(str, key if isinstance(key, tuple) else (key,)))} runs "
                                 f"differ in {mixed}: {reason} ({advice})")


def plan_sweep(task: Task, panels: Sequence[str], variants: Sequence[str], seeds: Sequence[int],
               overrides: Mapping[str, Any], folder: RunFolder) -> dict[str, list[RunSettings]]:
    """Every run's settings, per panel, with those already finished left out. A finished run of
    the same name with other settings raises :class:`~experiments.records.SettingsMismatch`, and
    an unfinished one whose checkpoint holds other settings ``ValueError``; a damaged record or
    checkpoint raises ``DamagedFile``; a run that would not agree with the folder's finished runs
    (:func:`require_agreement`: another seed of the same variant trained otherwise) raises
    ``ValueError``."""
    plan, asked = {}, []
    for panel in panels:
        runs = [task.settings_for(panel, v, s, overrides) for s in seeds for v in variants]  # paired by seed
        plan[panel] = [r for r in runs if not folder.finished(task.run_name(r), task.name, r.row())]
        for settings in plan[panel]:
            folder.require_resumable(task.run_name(settings), settings.row())
        asked += [r.row() for r in plan[panel]]
    if asked:
        finished = [r["settings"] for r in folder.records() if r["task"] == task.name]
        rows = pd.DataFrame(finished + asked, dtype=object)
        settings = [name for name in asked[0] if name != "seed"]
        require_agreement(rows, task, settings, f"{folder.out} holds runs of other settings: choose another --out")
    return plan


def run_sweep(task: Task, plan: Mapping[str, list[RunSettings]], folder: RunFolder, args: argparse.Namespace,
              parser: argparse.ArgumentParser, engine: Optional[Engine] = None) -> dict[str, pd.DataFrame]:
    """Train the planned runs (each by the processes of ``engine`` together) and write the tables;
    processes other than process 0 return no tables."""
    engine = engine or LocalEngine()
    for panel, runs in plan.items():
        if not runs:
            continue
        try:
            data = task.load(runs[0], args.data_root)
        except (ValueError, FileNotFoundError) as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        for settings in runs:
            name = task.run_name(settings)
            with claimed_by_process_zero(folder, name, engine) as ours:
                if not ours:
                    print(f"{name}: being trained by another process in {folder.out}, left to it", flush=True)
                    continue
                if engine.broadcast(engine.is_global_zero and folder.finished(name, task.name, settings.row())):
                    continue  # by another process since the plan
                record = train_one(task, settings, data, folder, args, engine)
            if not engine.is_global_zero:
                continue
            shown = ", ".join(f"{m} {record['metrics'][m]:.4g}" for m in task.metrics_of(panel) if m in record["metrics"])
            print(f"{panel} {settings.variant} seed {settings.seed}: {shown} ({record['wall_seconds']:.0f}s)", flush=True)
    if not engine.is_global_zero:
        return {}
    results = folder.write_results()
    asked = results[results[task.panel].isin(args.panels) & results["variant"].isin(args.variant)]
    return write_tables(task, asked, folder.out)


@contextlib.contextmanager
def claimed_by_process_zero(folder: RunFolder, name: str, engine: Engine) -> Iterator[bool]:
    """:meth:`RunFolder.claimed` by process 0, its answer on every process."""
    if not engine.is_global_zero:
        yield engine.broadcast(None)
        return
    with folder.claimed(name) as ours:
        yield engine.broadcast(ours)


def train_one(task: Task, settings: RunSettings, data: Any, folder: RunFolder, args: argparse.Namespace,
              engine: Optional[Engine] = None) -> dict:
    """Train one run (on every process of ``engine``) and save its record (process 0)."""
    engine = engine or LocalEngine()
    name = task.run_name(settings)
    with contextlib.ExitStack() as scratch:
        artifacts = folder.run_dir(name) if engine.is_global_zero else Path(
            scratch.enter_context(tempfile.TemporaryDirectory(prefix=f"{name}-process{engine.rank}-")))
        context = RunContext(artifacts, settings, progress=not args.no_progress, checkpoint_seconds=60 * args.checkpoint_minutes,
                             description=name, engine=engine, checkpoint=folder.run_dir(name) / CHECKPOINT)
        start = time.perf_counter()
        metrics = task.train(settings, data, context)
    metrics = {**metrics, **engine.mean({k: v for k, v in metrics.items() if isinstance(v, float)})}
    fit = context.fit_result
    training = None if fit is None else {
        "epochs": fit.epochs, "best_epoch": fit.best_epoch, "stopped_early": fit.stopped_early,
        "seconds": round(fit.seconds, 1), "monitors": fit.monitors, "history": fit.history}
    record = new_record(task.name, settings.row(), metrics, training, time.perf_counter() - start, engine.describe())
    if engine.is_global_zero:
        folder.save(name, record)
    return record


# --- finished runs ---------------------------------------------------------------------------


class TrainedRun(typing.NamedTuple):
    """A finished run, loaded: its settings, its panel's data and its model (eval mode)."""

    settings: RunSettings
    data: Any
    model: torch.nn.Module


def load_trained(task: Task, run_dir: os.PathLike, data_root: Optional[str] = None) -> TrainedRun:
    """The model of the finished run in ``run_dir`` (``<out>/runs/<run>``) as it was scored: the
    kept epoch's parameters under early stopping, else the last epoch's. The settings come from the
    run's record and the data from ``task.load``; errors name the run and what is missing."""
    run_dir = Path(run_dir)
    if task.build is None:
        raise ValueError(f"task {task.name!r} declares no build(settings, data): its models cannot be rebuilt")
    folder = RunFolder(run_dir.parent.parent)
    record = folder.record(run_dir.name)
    if record is None:
        state = "an unfinished run (it has a checkpoint)" if (run_dir / CHECKPOINT).is_file() else "not a run folder"
        raise ValueError(f"{run_dir}: no {RECORD}, {state}; pass the folder of a finished run, <out>/runs/<run>")
    if record["task"] != task.name:
        raise ValueError(f"{run_dir} is a run of task {record['task']!r}, not {task.name!r}")
    known = {f.name for f in dataclasses.fields(task.settings)}
    unknown = sorted(set(record["settings"]) - known)
    if unknown:
        raise ValueError(f"{run_dir}: its record has settings this version of {task.name} does not know: {unknown}")
    settings = task.settings(**record["settings"])
    if not (run_dir / CHECKPOINT).is_file():
        raise ValueError(f"{run_dir}: no {CHECKPOINT} (deleted?): the trained parameters are gone")
    folder.verify_checkpoint(run_dir.name, record)
    checkpoint = folder.finished_checkpoint(run_dir.name)
    differing = metadata_differences(checkpoint["metadata"], settings.row())
    if differing:
        raise ValueError(f"{run_dir}: its checkpoint was written with other settings than its record: {'; '.join(differing)}")
    data = task.load(settings, data_root)
    model = task.build(settings, data)
    kept = (checkpoint.get("early_stopping") or {}).get("best_state")
    model.load_state_dict(kept if kept is not None else checkpoint["model"])
    return TrainedRun(settings, data, model.eval())


# --- tables ----------------------------------------------------------------------------------


def paired_table(task: Task, results: pd.DataFrame) -> pd.DataFrame:
    """Per panel and variant (in the task's order of variants): mean ± std over seeds of each metric,
    the paired difference to soft of the first metric with its confidence interval, and the paper's
    figures of each metric it gives."""
    rank = {variant: i for i, variant in enumerate(task.variants)}
    tables = []
    for panel, runs in results.groupby(task.panel, sort=False):
        metrics = [m for m in task.metrics_of(panel) if m in runs]
        table = summarize(runs, [task.panel, "variant"], metrics)
        table = table.iloc[sorted(range(len(table)), key=lambda row: rank.get(table.index[row][1], len(rank)))]
        if metrics:
            paired = paired_difference(runs, [task.panel], metrics[0])[metrics[0]]
            table[f"{metrics[0]} - soft (paired)"] = paired.reindex(table.index).fillna("")
        paper = [task.paper.get(p, {}).get(v, {}) for p, v in table.index]
        for metric in [m for m in metrics if any(m in figures for figures in paper)]:
            table[f"paper {metric}"] = [figures.get(metric, "") for figures in paper]
        tables.append(table)
    if not tables:
        return pd.DataFrame()
    table = pd.concat(tables)
    paper_columns = [c for c in table if c.startswith("paper ")]
    table[paper_columns] = table[paper_columns].fillna("")  # panels the paper gives no figure for
    return table


def task_tables(task: Task, results: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The task's named tables of ``results`` (its ``tables``, else ``{"results": paired_table}``),
    their index turned into columns, ready for Markdown and CSV."""
    tables = task.tables(results) if task.tables else {"results": paired_table(task, results)}
    return {name: table.reset_index() if any(table.index.names) else table for name, table in tables.items()}


def write_tables(task: Task, results: pd.DataFrame, out: Path) -> dict[str, pd.DataFrame]:
    """``table.md`` (every table), ``table-<name>.csv`` each, and ``paired.png``; printed too."""
    tables = task_tables(task, results)
    text = "\n\n".join(f"### {name}\n\n{table.to_markdown(index=False, disable_numparse=True)}" for name, table in tables.items())
    (out / "table.md").write_text(text + "\n")
    for name, table in tables.items():
        table.to_csv(out / f"table-{name}.csv", index=False)
    drawn = {p: task.metrics_of(p)[0] for p in results[task.panel].unique() if task.metrics_of(p)}
    if drawn and not results.empty:
        paired_runs(results, task.panel, drawn, out / "paired.png")
    if task.after_sweep is not None and not results.empty:
        task.after_sweep(results, out)
    print(text)
    return tables


__all__ = ["RunContext", "RunSettings", "SettingsMismatch", "Task", "TrainedRun", "load_trained", "model_device", "positive",
           "require", "run_cli", "setting_differences", "whole_number"]
