"""The README's library example runs as written."""

import re
from pathlib import Path


def test_readme_python_example_runs():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert namespace["draws"]["y"].shape == (50, 16)
    assert namespace["logits"].shape == (16, 2)
