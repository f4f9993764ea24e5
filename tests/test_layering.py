"""The import structure: no module imports a layer above its own, no modules import each other, no
task imports another, and every import is seen.

Layers, lowest first: ``bam_pyro`` < ``models``, ``guides`` < ``analysis`` < ``experiments``. Every
``import`` statement counts, also those inside functions (an import deferred to call time is still
a dependency) and those under ``TYPE_CHECKING``; so does an import written as a call,
``importlib.import_module("a.b")`` or ``__import__("a.b")``. A call whose module name is not a
string in the source cannot be checked: only the modules of :data:`DYNAMIC_IMPORTS` may make one,
each saying why it is safe. An import of a folder of the project that is not a layer (``tests``,
``docs``, a new top-level folder) fails: a new folder is added to :data:`LAYERS` first.

Tasks: each package directly under ``experiments/`` but the runner is a task folder. No module
imports a task folder but the folder's own: a task imports the runner and the shared modules, never
another task, and the tools that run every task find them through :mod:`experiments.catalog`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from experiments.catalog import NOT_TASKS

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"bam_pyro": 0, "models": 1, "guides": 1, "analysis": 2, "experiments": 3}
#: module -> why its imports by a computed name are safe
DYNAMIC_IMPORTS = {
    "bam_pyro.optional": "imports the optional third-party packages, the keys of EXTRAS",
    "experiments.catalog": "imports experiments.<task> packages, each of them checked here as a module of its own",
}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the layered packages (a package by its ``__init__``)."""
    modules = {}
    for package in LAYERS:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def project_folders(root: Path = ROOT) -> set[str]:
    """The names a module of the project can be imported by: the top-level folders that hold Python
    files, and the top-level modules."""
    folders = {path.name for path in root.iterdir() if path.is_dir() and not path.name.startswith(".")
               and next(path.rglob("*.py"), None) is not None}
    return folders | {path.stem for path in root.glob("*.py")}


def is_import_call(node: ast.AST) -> bool:
    """``import_module(...)``, ``importlib.import_module(...)`` or ``__import__(...)``."""
    if not isinstance(node, ast.Call):
        return False
    name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) else None
    return name in ("import_module", "__import__")


def read_imports(name: str, path: Path) -> tuple[set[str], list[int]]:
    """Every dotted name the module imports, relative imports resolved (``from a import b`` names
    ``a.b``, b may be a submodule, and ``a``; a call with a string names that string), and the
    lines of the calls whose module name is computed."""
    names, computed = set(), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif is_import_call(node):
            target = node.args[0] if node.args else None
            if isinstance(target, ast.Constant) and isinstance(target.value, str) and not target.value.startswith("."):
                names.add(target.value)
            else:
                computed.append(node.lineno)
    return names, computed


def imported_names(name: str, path: Path) -> set[str]:
    return read_imports(name, path)[0]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolves to its longest module prefix)."""
    modules = project_modules(root)
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(name, path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> int:
    return LAYERS[module.split(".")[0]]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{source} -> {target}" for source, targets in sorted(graph.items()) for target in sorted(targets)
            if layer(target) > layer(source)]


def unlisted_imports(root: Path = ROOT) -> list[str]:
    """Imports of a project folder that is not a layer, as ``module -> name``."""
    unlisted = project_folders(root) - set(LAYERS)
    return [f"{name} -> {imported}" for name, path in sorted(project_modules(root).items())
            for imported in sorted(imported_names(name, path)) if imported.split(".")[0] in unlisted]


def computed_imports(root: Path = ROOT) -> dict[str, list[int]]:
    """Module -> the lines of its imports by a computed name."""
    found = {name: read_imports(name, path)[1] for name, path in project_modules(root).items()}
    return {name: lines for name, lines in sorted(found.items()) if lines}


def task_folders(root: Path = ROOT) -> set[str]:
    return {path.parent.name for path in (root / "experiments").glob("*/__init__.py") if path.parent.name not in NOT_TASKS}


def task_of(module: str, tasks: set[str]) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "experiments" and len(parts) > 1 and parts[1] in tasks else None


def cross_task_imports(graph: dict[str, set[str]], tasks: set[str]) -> list[str]:
    """Imports of a task folder by a module outside it."""
    return [f"{source} -> {target}" for source, targets in sorted(graph.items()) for target in sorted(targets)
            if task_of(target, tasks) not in (None, task_of(source, tasks))]


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_module_imports_a_project_folder_that_is_not_a_layer():
    assert project_folders() - set(LAYERS) >= {"tests", "docs"}
    assert unlisted_imports() == []


def test_only_the_listed_modules_import_by_a_computed_name():
    found = computed_imports()
    assert set(found) == set(DYNAMIC_IMPORTS), found  # and each listed module still needs its entry


def test_no_task_imports_another_and_only_the_catalog_finds_them():
    tasks = task_folders()
    assert tasks >= {"captioning", "gat", "glue", "nmt", "vqa"}  # a new task adds itself
    assert cross_task_imports(import_graph(), tasks) == []


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A toy checkout: an empty ``__init__.py`` in every layer, then ``files`` (path -> source)."""
    for package in LAYERS:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checks_see_function_level_relative_and_upward_imports(tmp_path):
    """The checks fail where they should: on a toy tree with one upward import and one cycle,
    both made by imports that only run inside a function."""
    write_tree(tmp_path, {"bam_pyro/core.py": "def f():\n    from experiments.task import x\n",
                          "experiments/task.py": "from .cli import main\n",
                          "experiments/cli.py": "def main():\n    from experiments import task\n"})
    graph = import_graph(tmp_path)
    assert graph["bam_pyro.core"] == {"experiments.task"} and upward_imports(graph) == ["bam_pyro.core -> experiments.task"]
    assert cycles(graph) == [["experiments.cli", "experiments.task"]]


def test_the_checks_see_imports_of_folders_that_are_not_layers(tmp_path):
    write_tree(tmp_path, {"tests/helpers.py": "", "tools/report.py": "", "docs/notes.md": "",
                          "bam_pyro/core.py": "from tests.helpers import make\n",
                          "models/net.py": "def f():\n    import tools.report\n"})
    assert project_folders(tmp_path) == {*LAYERS, "tests", "tools"}
    assert unlisted_imports(tmp_path) == ["bam_pyro.core -> tests.helpers.make", "models.net -> tools.report"]


def test_the_checks_see_imports_written_as_calls(tmp_path):
    write_tree(tmp_path, {"experiments/task.py": "",
                          "bam_pyro/core.py": "import importlib\n\ndef f():\n    return importlib.import_module('experiments.task')\n",
                          "models/net.py": "def f():\n    return __import__('experiments.task')\n",
                          "analysis/plots.py": "from importlib import import_module\n\ndef f(name):\n"
                                               "    return import_module(f'experiments.{name}')\n"})
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == ["bam_pyro.core -> experiments.task", "models.net -> experiments.task"]
    assert computed_imports(tmp_path) == {"analysis.plots": [4]}


def test_the_checks_see_one_task_importing_another(tmp_path):
    write_tree(tmp_path, {"experiments/runner/__init__.py": "", "experiments/records.py": "",
                          "experiments/gat/__init__.py": "", "experiments/gat/task.py": "from experiments.runner import x\n",
                          "experiments/nmt/__init__.py": "", "experiments/nmt/task.py": "",
                          "experiments/captioning/__init__.py": "",
                          "experiments/captioning/task.py": "from experiments.nmt.task import Trainable\nfrom . import data\n",
                          "experiments/captioning/data.py": "from experiments.records import y\n",
                          "experiments/results.py": "from experiments.gat.task import TASK\n"})
    tasks = task_folders(tmp_path)
    assert tasks == {"captioning", "gat", "nmt"}
    assert cross_task_imports(import_graph(tmp_path), tasks) == ["experiments.captioning.task -> experiments.nmt.task",
                                                                 "experiments.results -> experiments.gat.task"]
