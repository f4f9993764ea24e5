"""The README's library examples run as written, one after the other as a reader would paste them."""

import re
from pathlib import Path


def test_readme_python_examples_run(tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 5, "README lost its python examples"
    monkeypatch.chdir(tmp_path)  # the transformers example saves a model folder
    namespace: dict = {}
    for number, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {number + 1}", "exec"), namespace)
    assert namespace["draws"]["y"].shape == (50, 16)
    assert namespace["logits"].shape == (16, 2)
    assert namespace["hf_model"].config._attn_implementation == "bam" and (tmp_path / "bam-minilm").is_dir()
    assert issubclass(namespace["Guide"], namespace["AttentionGuide"])
