"""The ```python blocks of a Markdown file, for the tests that run the documentation's examples."""

from __future__ import annotations

import re
from pathlib import Path

_FENCE = re.compile(r"^```([^`\n]*)\n(.*?)^```[ \t]*$", flags=re.S | re.M)


def fenced_blocks(path: str | Path) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block of the Markdown file at ``path``, in order
    (the language is what follows the opening fence, ``""`` if nothing does)."""
    return [(language.strip(), code) for language, code in _FENCE.findall(Path(path).read_text(encoding="utf-8"))]


def python_blocks(path: str | Path) -> list[str]:
    """The code of every fenced ```python block of the Markdown file at ``path``, in order."""
    return [code for language, code in fenced_blocks(path) if language == "python"]


ROOT = Path(__file__).resolve().parents[1]
#: the pages whose examples a reader runs first: every block must work from an installed wheel
EXAMPLE_PAGES = (ROOT / "README.md", ROOT / "docs" / "getting-started.md")


def run_blocks(*paths: Path) -> dict:
    """Execute the blocks of ``paths`` one after the other in one namespace and return it (a page
    may continue the example of the page before it)."""
    namespace: dict = {}
    for path in paths:
        for number, block in enumerate(python_blocks(path), start=1):
            exec(compile(block, f"{Path(path).name} python block {number}", "exec"), namespace)
    return namespace
