"""The command line: one option per settings field, the sweep's and the devices' options, and
:func:`run_cli`, which checks everything that needs no data before the sweep starts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Callable, Literal, Optional, Sequence, Union

import pandas as pd
import torch

from bam_pyro.distributed import ACCELERATORS, PRECISIONS, STRATEGIES, DeviceSettings, engine_for
from experiments.records import RunFolder, require_writable_folder
from experiments.runner.sweep import plan_sweep, run_sweep
from experiments.runner.task import RunSettings, Task


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
    parser.add_argument("--wait", action="store_true",
                        help="wait for runs another process is training in --out (default: leave them to it)")
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
    the tables. User errors end the command with one line and status 2; Ctrl-C (SIGINT) with one
    line and status 130, each run's checkpoint as last written."""
    parser, names = build_parser(task)
    args = parser.parse_args(argv)
    folder = RunFolder(args.out)
    try:
        if args.checkpoint_minutes < 0:
            raise ValueError(f"--checkpoint-minutes must be >= 0, got {args.checkpoint_minutes}")
        if args.data_root is not None and task.data_source:
            raise ValueError(f"--data-root is not read by {task.name}: its data come from {task.data_source}")
        require_writable_folder(args.out, room=folder.largest_checkpoint())
        engine = engine_for(DeviceSettings(args.accelerator, args.devices, args.num_nodes, args.strategy, args.precision,
                                           args.deterministic))
        plan = plan_sweep(task, args.panels, args.variant, args.seeds, {n: getattr(args, n) for n in names}, folder)
    except (ValueError, TypeError, ImportError) as error:
        parser.exit(2, f"{parser.prog}: error: {str(error).strip().splitlines()[0]}\n")
    torch.set_num_threads(args.threads)
    try:
        return run_sweep(task, engine.broadcast(plan), folder, args, parser, engine)
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted; the same command resumes from the last checkpoint in {args.out}\n")
