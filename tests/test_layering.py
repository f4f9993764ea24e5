"""The import structure: no module imports a layer above its own, and no modules import each other.

Layers, lowest first: ``bam_pyro`` < ``models``, ``guides`` < ``analysis`` < ``experiments``. Every
``import`` statement counts, also those inside functions (an import deferred to call time is still
a dependency) and those under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"bam_pyro": 0, "models": 1, "guides": 1, "analysis": 2, "experiments": 3}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the layered packages (a package by its ``__init__``)."""
    modules = {}
    for package in LAYERS:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name the module's import statements name, relative imports resolved;
    ``from a import b`` names ``a.b`` (b may be a submodule) and ``a``."""
    names = set()
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
    return names


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


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{source} -> {target}" for source, targets in import_graph().items() for target in sorted(targets)
              if layer(target) > layer(source)]
    assert upward == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_see_function_level_relative_and_upward_imports(tmp_path):
    """The checks fail where they should: on a toy tree with one upward import and one cycle,
    both made by imports that only run inside a function."""
    for package in LAYERS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "bam_pyro" / "core.py").write_text("def f():\n    from experiments.task import x\n")
    (tmp_path / "experiments" / "task.py").write_text("from .cli import main\n")
    (tmp_path / "experiments" / "cli.py").write_text("def main():\n    from experiments import task\n")
    graph = import_graph(tmp_path)
    assert graph["bam_pyro.core"] == {"experiments.task"} and layer("experiments.task") > layer("bam_pyro.core")
    assert cycles(graph) == [["experiments.cli", "experiments.task"]]
