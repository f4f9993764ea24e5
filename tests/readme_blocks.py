"""The Python examples of a Markdown page, in reading order: the README's and the getting-started
page's blocks are run as a reader would paste them (from the checkout here, from an installed
wheel in the packaging test)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PAGES = (ROOT / "README.md", ROOT / "docs" / "getting-started.md")
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    """Every fenced ```python block of ``path``, in order; later blocks may use earlier ones' names."""
    return BLOCK.findall(Path(path).read_text())


def run_blocks(*paths: Path) -> dict:
    """Execute the blocks of ``paths`` one after the other in one namespace and return it (a page
    may continue the example of the page before it)."""
    namespace: dict = {}
    for path in paths:
        for number, block in enumerate(python_blocks(path), start=1):
            exec(compile(block, f"{Path(path).name} python block {number}", "exec"), namespace)
    return namespace
