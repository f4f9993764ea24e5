"""The documentation site: it builds in strict mode (a warning fails it), its API reference covers
every module of the library, and the examples of its integration pages run."""

import ast
import functools
import io
import os
import re
import runpy
import subprocess
import sys
import tomllib
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from experiments import catalog
from tests.readme_blocks import EXAMPLE_PAGES, ROOT, fenced_blocks, python_blocks, run_blocks

DOCS = ROOT / "docs"
#: every page a reader reads: the README and the site's sources
PAGES = (ROOT / "README.md", *sorted(DOCS.rglob("*.md")))
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
    ("integrations/alignment.md",): lambda ns: (set(ns["losses"]) == {"exact", "hard", "hard-enum"}
                                                and all(0 < loss < 5 for loss in ns["losses"].values())
                                                and ns["t"] == 2),
}
# ``python -m experiments.X ...`` (or ``torchrun ... -m``) in a code block or span: the module and what follows it
COMMAND = re.compile(r"(?:^|\s)-m\s+((?:experiments|analysis)(?:\.\w+)+)((?:[ \t]+[^\s#`|;&<>]+)*)")


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


def holds_python(code: str) -> bool:
    """The block is Python: it parses (a shell command, a listing or a directory tree does not)."""
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return bool(code.strip())


def test_every_block_that_holds_python_is_marked_python():
    """A Python example in a ``text`` (or unmarked) block is run by no test."""
    unmarked = [f"{page.relative_to(ROOT)}, block {number} ({language or 'unmarked'})"
                for page in PAGES for number, (language, code) in enumerate(fenced_blocks(page), start=1)
                if language != "python" and holds_python(code)]
    assert unmarked == []


def documented_commands(pages: tuple[Path, ...] = PAGES) -> dict[tuple[str, ...], dict[str, set[str]]]:
    """Every command of the pages' code blocks and spans (``bench NAME ...`` in a span, the tables'
    short form, included): (module, bench name for experiments.bench) -> the options shown with it
    -> the pages showing them."""
    commands: dict[tuple[str, ...], dict[str, set[str]]] = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        blocks = [code for _, code in fenced_blocks(page)]
        prose = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)
        spans = [re.sub(r"^bench ", "python -m experiments.bench ", " ".join(span.split()))
                 for span in re.findall(r"`([^`]+)`", prose) if "\n\n" not in span]
        for code in blocks + spans:
            for module, rest in COMMAND.findall(code.replace("\\\n", " ")):
                words = rest.split()
                command = (module, words[0]) if module == "experiments.bench" and words else (module,)
                options = commands.setdefault(command, {})
                for word in words:
                    if word.startswith("--"):
                        shown = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
                        options.setdefault(word.split("=")[0], set()).add(str(shown))
    return commands


@functools.cache
def help_options(command: tuple[str, ...]) -> frozenset[str]:
    """The options ``python -m <command> --help`` lists (run in this process: one import of torch)."""
    module, *arguments = command
    printed, saved = io.StringIO(), sys.argv
    sys.argv = [module, *arguments, "--help"]
    try:
        with redirect_stdout(printed), pytest.raises(SystemExit), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)  # the package is imported: fine
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = saved
    return frozenset(re.findall(r"--[\w-]+", printed.getvalue()))


def options_missing_from_help(pages: tuple[Path, ...]) -> list[str]:
    """``<command> <option> (<pages>)`` for every option the pages show that the command's --help lacks."""
    return [f"{' '.join(command)} {option} ({', '.join(sorted(shown))})"
            for command, options in sorted(documented_commands(pages).items())
            for option, shown in sorted(options.items()) if option not in help_options(command)]


def test_documented_commands_offer_the_options_shown():
    """Every ``python -m experiments.X --option`` of the README and the docs is one its --help lists."""
    commands = documented_commands()
    assert ("experiments.bench", "gat") in commands and ("experiments.gat",) in commands  # the parsing finds them
    assert options_missing_from_help(PAGES) == []


def test_an_option_a_command_lacks_is_found(tmp_path):
    """The check itself: ``bench predictive`` takes ``--repeats``, not ``--steps`` (in a block or a span)."""
    (tmp_path / "page.md").write_text("```bash\npython -m experiments.bench predictive --steps 3 \\\n  --threads 1\n```\n\n"
                                      "Then `bench predictive --repeats 2 --chunks 5` and `python -m experiments.gat --seed 1`.\n")
    assert options_missing_from_help((tmp_path / "page.md",)) == [
        "experiments.bench predictive --chunks (page.md)", "experiments.bench predictive --steps (page.md)",
        "experiments.gat --seed (page.md)",
    ]


def test_install_lists_offer_every_extra():
    """The README's and the getting-started page's install lists show every extra a user installs."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]) - {"docs", "test"}
    for page in EXAMPLE_PAGES:
        shown = set(re.findall(r"bam-pyro\[(\w+)\]", page.read_text(encoding="utf-8")))
        assert extras - shown == set(), page.name


def test_the_readme_and_the_benchmarks_page_name_every_bench():
    benches = set(catalog.benchmarks())
    listed = re.search(r"Benchmarks \((.*?)\) are in", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    assert listed and benches - set(re.findall(r"[\w-]+", listed.group(1))) == set()
    shown = {command[1] for command in documented_commands((DOCS / "benchmarks.md",)) if len(command) == 2}
    assert benches - shown == set()
