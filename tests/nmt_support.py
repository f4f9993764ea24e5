"""Helpers of the translation tests: a tiny parallel corpus on disk and, until the experiment runner
lands, a stand-in for the part of ``experiments.runner`` that ``experiments.nmt`` imports.

The stand-in holds exactly the interface of ``prompts/runner_api.md`` (settings base class with the
flat attention fields, ``Task``, ``RunContext``); it is installed only when the real module is
absent, so the tests run unchanged on the real runner. Delete it once the runner is merged.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

from bam_pyro import VARIANTS, BamConfig, ObjectiveConfig


def _standin_runner() -> types.ModuleType:
    @dataclasses.dataclass(frozen=True)
    class RunSettings:
        variant: str = "soft"
        seed: int = 0
        k: float = 1.0
        sigma_q: float = 1.0
        sigma_p: float = 1.0
        mu_p: float = 0.0
        beta: float = 1.0
        alpha: float = 1.0
        gamma_shape: str = "psi_beta"
        prior_scope: str = "query_keys"
        d_mid: int = 1
        detach_prior_keys: bool = False
        reduction: str = "mean"
        kl_weight: float = 1.0
        anneal_rate: Optional[float] = None

        def __post_init__(self) -> None:
            self.attention, self.objective  # noqa: B018  (validates)

        @property
        def attention(self) -> BamConfig:
            names = [f.name for f in dataclasses.fields(BamConfig) if f.name != "variant"]
            variant = self.variant if self.variant in VARIANTS else "soft"
            return BamConfig(variant=variant, **{name: getattr(self, name) for name in names})

        @property
        def objective(self) -> ObjectiveConfig:
            return ObjectiveConfig(self.reduction, self.kl_weight, self.anneal_rate)

    @dataclasses.dataclass(frozen=True)
    class Task:
        name: str
        settings: type
        panel: str
        panels: tuple
        variants: tuple
        presets: Callable
        load: Callable
        train: Callable
        metrics: tuple
        paper: dict = dataclasses.field(default_factory=dict)

    @dataclasses.dataclass
    class RunContext:
        trainer: Callable
        folder: Path
        progress: bool = False
        description: str = "run"

    def run_cli(task: Any, argv: Any = None) -> Any:
        raise NotImplementedError("the experiment runner is not merged into this checkout yet")

    module = types.ModuleType("experiments.runner")
    module.STANDIN = True
    module.RunSettings, module.Task, module.RunContext, module.run_cli = RunSettings, Task, RunContext, run_cli
    return module


def runner_is_missing() -> bool:
    """True without the real runner (whether or not the stand-in is installed)."""
    if "experiments.runner" in sys.modules:
        return getattr(sys.modules["experiments.runner"], "STANDIN", False)
    return importlib.util.find_spec("experiments.runner") is None


def install_runner_standin() -> None:
    if runner_is_missing() and "experiments.runner" not in sys.modules:
        sys.modules["experiments.runner"] = _standin_runner()


def standin_for_child_processes(folder: Path, monkeypatch) -> None:
    """Fresh processes (the benchmarks') install the stand-in too: a ``sitecustomize`` on their path."""
    if not runner_is_missing():
        return
    (folder / "sitecustomize.py").write_text("import tests.nmt_support\n")
    path = [str(folder), str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))


install_runner_standin()

#: a toy corpus: German-ish sources, English-ish targets, word for word
GERMAN = ["ein", "zwei", "mann", "frau", "hund", "katze", "sitzt", "läuft", "auf", "dem", "rot", "blau"]
ENGLISH = ["a", "two", "man", "woman", "dog", "cat", "sits", "runs", "on", "the", "red", "blue"]


def toy_pairs(count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``count`` sentence pairs of 3 to 8 words, each English word the translation of its German one."""
    import random

    rng = random.Random(seed)
    source, target = [], []
    for _ in range(count):
        words = [rng.randrange(len(GERMAN)) for _ in range(rng.randint(3, 8))]
        source.append(" ".join(GERMAN[w] for w in words).capitalize() + ".")
        target.append(" ".join(ENGLISH[w] for w in words).capitalize() + ".")
    return source, target


def write_corpus(root: Path, sizes: tuple[int, int, int] = (300, 40, 40), copy: bool = False) -> Path:
    """A data root holding ``multi30k/{train,val,test_2016_flickr}.{de,en}.gz`` of toy pairs
    (``copy``: the English sentence on both sides, a task a small model learns in seconds)."""
    folder = root / "multi30k"
    folder.mkdir(parents=True, exist_ok=True)
    for seed, (stem, count) in enumerate(zip(("train", "val", "test_2016_flickr"), sizes)):
        source, target = toy_pairs(count, seed)
        for lang, lines in zip(("de", "en"), (target if copy else source, target)):
            with gzip.open(folder / f"{stem}.{lang}.gz", "wt", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
    return root
