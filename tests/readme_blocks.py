"""The ```python blocks of a Markdown file, for the tests that run the documentation's examples."""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)


def python_blocks(path: str | Path) -> list[str]:
    """The code of every fenced ```python block of the Markdown file at ``path``, in order."""
    return _BLOCK.findall(Path(path).read_text(encoding="utf-8"))
