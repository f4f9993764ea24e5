"""The Python examples of the README and of the docs' getting-started page run as written, from the
checkout, each page's blocks one after the other as a reader would paste them."""

from tests.readme_blocks import EXAMPLE_PAGES, ROOT, python_blocks, run_blocks


def test_example_pages_have_examples():
    readme, getting_started = (python_blocks(page) for page in EXAMPLE_PAGES)
    assert len(readme) >= 4, "README lost its python examples"
    assert len(getting_started) >= 1, "the getting-started page lost its example"


def test_readme_examples_import_only_the_library():
    """A reader without the checkout has only bam_pyro: no example may import the task folders."""
    for page in EXAMPLE_PAGES:
        for block in python_blocks(page):
            for folder in ("models", "guides", "experiments", "analysis", "tests"):
                assert f"from {folder}" not in block and f"import {folder}" not in block, (page.name, folder)


def test_readme_python_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the transformers example saves a model folder
    namespace = run_blocks(ROOT / "README.md")
    assert namespace["draws"]["y"].shape == (50, 16)
    assert namespace["logits"].shape == (16, 2)
    assert namespace["hf_model"].config._attn_implementation == "bam" and (tmp_path / "bam-minilm").is_dir()
    assert issubclass(namespace["Guide"], namespace["AttentionGuide"])
    assert namespace["Net"](1433, 8, 7).conv1.__class__.__name__ == "BayesianGATConv"


def test_getting_started_example_runs_and_learns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(ROOT / "docs" / "getting-started.md")
    assert namespace["draws"].shape == (20, 64)
    assert namespace["accuracy"] >= 0.9, "the SVI example no longer learns its toy label"

