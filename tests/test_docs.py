"""The documentation site: it builds in strict mode (a warning fails it), its API reference covers
every module of the library, and the examples of its integration pages run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.readme_blocks import ROOT, python_blocks, run_blocks

DOCS = ROOT / "docs"
# pages whose Python blocks run, each chain in one namespace (a page continues the one before it),
# and what the last page's example must leave behind
EXAMPLE_CHAINS = {
    ("getting-started.md", "integrations/pyro.md"): lambda ns: ns["posterior"]["temperature"].shape == (10, 1),
    ("integrations/pyg.md",): lambda ns: ns["attention_draws"].shape[0] == 20 and ns["logits"].shape == (6, 3),
    ("integrations/transformers.md",): lambda ns: len(ns["attentions"]) == 6 and Path("bam-minilm").is_dir(),
    ("scaling.md",): lambda ns: (ns["trainer"].state.global_step == 2
                                 and Path("runs/trainer/config.json").is_file()),
    ("tasks/captioning-scores.md",): lambda ns: (set(ns["scores"]) == {"bleu1", "bleu2", "bleu3", "bleu4", "rouge_l", "cider"}
                                                   and 0 < ns["scores"]["bleu1"] <= 100),
}


def test_site_builds_strictly(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    log = build.stdout + build.stderr
    assert build.returncode == 0, log
    assert not re.search(r"^(WARNING|ERROR)\b", log, flags=re.M), log
    assert (tmp_path / "site" / "api" / "inference" / "index.html").is_file()


def test_api_reference_covers_every_module():
    """A module added to bam_pyro without a place in the API reference fails here."""
    package = ROOT / "bam_pyro"
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in package.rglob("*.py")
        if not path.name.startswith("_") or path.name == "__init__.py"
    }
    documented = {
        line.removeprefix(":::").strip()
        for page in (DOCS / "api").glob("*.md")
        for line in page.read_text().splitlines()
        if line.startswith(":::")
    }
    assert modules - documented == set()


PACKAGE = {
    "__init__.py": '''"""See :class:`~pkg.mod.Thing` and :class:`torch.Tensor`.

=====  =====
name   role
=====  =====
``a``  :func:`pkg.mod.make`
=====  =====
"""''',
    "mod.py": '''"""Holds :class:`Thing` and :class:`pkg.mod.Missing`."""


class Thing:
    """A thing.

    size: how big, in units of
        :func:`make`.
    colour: not a parameter of Thing.
    """

    def __init__(self, size: int) -> None:
        self.size = size


def make() -> Thing:
    """Make one::

        Thing(1)
    """
''',
}


def test_docstring_rest_is_read_as_markdown(tmp_path):
    """docs/griffe_roles.py: roles become links inside the package (an unknown one too, for the
    strict build to report) and code outside it; tables, fields and literal markers become Markdown."""
    griffe = pytest.importorskip("griffe")
    (tmp_path / "pkg").mkdir()
    for name, source in PACKAGE.items():
        (tmp_path / "pkg" / name).write_text(source)
    extensions = griffe.load_extensions(str(DOCS / "griffe_roles.py"))
    package = griffe.load("pkg", search_paths=[str(tmp_path)], extensions=extensions)
    assert package.docstring.value.startswith("See [`Thing`][pkg.mod.Thing] and `torch.Tensor`.")
    assert "| name | role |\n|---|---|\n| ``a`` | [`pkg.mod.make`][pkg.mod.make] |" in package.docstring.value
    assert package["mod"].docstring.value == "Holds [`Thing`][pkg.mod.Thing] and [`pkg.mod.Missing`][pkg.mod.Missing]."
    thing = package["mod.Thing"].docstring.value
    assert "\n- `size`: how big, in units of\n    [`make`][pkg.mod.make]." in thing
    assert "\ncolour: not a parameter" in thing
    assert package["mod.make"].docstring.value.startswith("Make one:\n")


def test_every_page_with_examples_is_run():
    with_examples = {
        str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md") if python_blocks(page)
    }
    assert with_examples == {page for chain in EXAMPLE_CHAINS for page in chain}


@pytest.mark.parametrize("chain", EXAMPLE_CHAINS, ids=lambda chain: chain[-1])
def test_integration_examples_run(chain, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the transformers example saves a model folder
    namespace = run_blocks(*(DOCS / page for page in chain))
    assert EXAMPLE_CHAINS[chain](namespace)
