import os
from pathlib import Path

import pytest
import torch

import bam_pyro  # noqa: F401  (registers the KLs)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def pytest_configure(config): config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped cleanly without one)")  # noqa: E704


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = Path(os.environ.get("BAM_DATA", SHARED_DATA))
    if not (root / "planetoid" / "Cora" / "raw").is_dir():
        pytest.fail(f"test data not found under {root}; set BAM_DATA to the data root")
    return root


@pytest.fixture(scope="session")
def cora(data_root):
    from experiments.gat.planetoid import load_planetoid

    return load_planetoid("cora", data_root)


@pytest.fixture(scope="session")
def tiny_bert_folder(tmp_path_factory) -> Path:
    """A folder holding a tiny randomly initialized BERT classifier beside the MiniLM tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from bam_pyro.transformers import DEFAULT_MODEL, resolve_pretrained

    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained(DEFAULT_MODEL))
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    folder = tmp_path_factory.mktemp("tiny-bert")
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_graph(num_nodes: int = 30, num_edges: int = 90, num_features: int = 12, seed: int = 0):
    """A small random directed graph with features and 3 classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_nodes, num_features, generator=g)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=g)
    y = torch.randint(0, 3, (num_nodes,), generator=g)
    return x, edge_index, y
