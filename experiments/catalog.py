"""The tasks, found by their folders: every package directly under ``experiments/`` but the runner
is a task, ``experiments/<task>/``, whose ``__init__`` declares in ``FOLDER`` (a :class:`TaskFolder`)
what the tools around the tasks run: its benchmarks (``python -m experiments.bench``), its parts of
the GPU check (``python -m experiments.gpu_check``) and whether it publishes committed results
(``python -m experiments.results``). The tools read these declarations, so a new task is a new
folder and nothing else to edit.

A declaration imports nothing but this module, which imports only the standard library: the GPU
check reads the declarations before it has installed the packages the tasks need. The task itself
(``experiments.<task>.task.TASK``) and its benchmarks are imported only when one is run.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

import experiments

#: the packages under experiments/ that are not tasks
NOT_TASKS = ("runner",)

#: placeholders in the GPU check's options, which it fills in: ``--data-root DIR`` where it was given
#: one; ``--model DIR``, the stand-in for the pretrained MiniLM where its files travelled (else the
#: part needs the MiniLM's package); ``--threads N``, the machine's cores
DATA_ROOT, PRETRAINED, ALL_CORES = "{data-root}", "{pretrained}", "{all-cores}"


@dataclass(frozen=True)
class Benchmark:
    """``python -m experiments.bench <name>``: the ``main(argv)`` of ``experiments.<task>.<module>``,
    described in one line. The GPU check runs it with ``check_options`` and ``--device cuda``
    within ``check_budget_s`` seconds, where ``check_modules`` import."""

    name: str
    module: str
    description: str
    check_options: tuple[str, ...] = ()
    check_budget_s: int = 20
    check_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckRun:
    """A short bf16 training run of the GPU check, ``train-<name>``: ``python -m experiments.<task>
    <options>`` within ``budget_s`` seconds, where ``modules`` import."""

    name: str
    options: tuple[str, ...]
    budget_s: int
    modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckStep:
    """A step of the GPU check before its tests (data the benchmarks and runs read, computed once):
    ``python -m experiments.<task>.<module> <options>``, on a machine with or without a GPU
    (``needs_gpu``), where ``modules`` import."""

    name: str
    module: str
    options: tuple[str, ...]
    budget_s: int
    modules: tuple[str, ...] = ()
    needs_gpu: bool = True


@dataclass(frozen=True)
class TaskFolder:
    """What ``experiments/<name>/`` holds besides its task: see the module docstring.
    ``publishes``: ``experiments.<name>.published.PUBLISHED`` lists the tables and figures of the
    docs drawn from its committed records."""

    name: str
    benchmarks: tuple[Benchmark, ...] = ()
    check_steps: tuple[CheckStep, ...] = ()
    check_runs: tuple[CheckRun, ...] = ()
    publishes: bool = False

    @property
    def package(self) -> str:
        return f"experiments.{self.name}"


def task_names() -> list[str]:
    """The task folders' names, in alphabetical order: the packages under experiments/ but the runner."""
    return sorted(module.name for module in pkgutil.iter_modules(experiments.__path__)
                  if module.ispkg and module.name not in NOT_TASKS)


def task_folder(name: str) -> TaskFolder:
    """The declaration of ``experiments/<name>/``; a folder without one, or declaring another name, is refused."""
    if name not in task_names():
        raise ValueError(f"no task {name!r}; the tasks are {task_names()}")
    folder = getattr(importlib.import_module(f"experiments.{name}"), "FOLDER", None)
    if not isinstance(folder, TaskFolder):
        raise TypeError(f"experiments/{name}/__init__.py declares no FOLDER = TaskFolder(...): every package under "
                        f"experiments/ but {list(NOT_TASKS)} is a task")
    if folder.name != name:
        raise ValueError(f"experiments/{name}/__init__.py declares the task {folder.name!r}; name it {name!r}")
    return folder


def task_folders() -> list[TaskFolder]:
    return [task_folder(name) for name in task_names()]


def load_task(name: str) -> Any:
    """The runner's declaration of task ``name``: ``experiments.<name>.task.TASK`` (a
    :class:`experiments.runner.Task`), imported with everything the task needs."""
    return importlib.import_module(f"{task_folder(name).package}.task").TASK


def benchmarks() -> dict[str, tuple[TaskFolder, Benchmark]]:
    """Every task's benchmarks by name, with the folder that declares each; two of one name are refused."""
    found: dict[str, tuple[TaskFolder, Benchmark]] = {}
    for folder in task_folders():
        for benchmark in folder.benchmarks:
            if benchmark.name in found:
                raise ValueError(f"benchmark {benchmark.name!r} is declared by tasks {found[benchmark.name][0].name!r} "
                                 f"and {folder.name!r}")
            found[benchmark.name] = (folder, benchmark)
    return found


def benchmark_module(folder: TaskFolder, benchmark: Benchmark) -> str:
    return f"{folder.package}.{benchmark.module}"


def benchmark_main(name: str) -> Callable[[list[str]], Any]:
    """The ``main(argv)`` of benchmark ``name``."""
    folder, benchmark = benchmarks()[name]
    return importlib.import_module(benchmark_module(folder, benchmark)).main


def published(name: str) -> tuple:
    """The tables and figures task ``name`` publishes to the docs (``experiments.<name>.published``)."""
    folder = task_folder(name)
    if not folder.publishes:
        raise ValueError(f"task {name!r} publishes no results")
    return importlib.import_module(f"{folder.package}.published").PUBLISHED
