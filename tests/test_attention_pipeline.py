"""One attention-diagnostics pipeline for every task: the graph, VQA and translation tasks draw
their chains through :mod:`bam_pyro.diagnostics`, whose one seeding rule gives chain c of a run
seeded s the seed s + c, and leaves the caller's random state alone."""

import random
from types import SimpleNamespace

import numpy as np
import pyro
import pytest
import torch

from bam_pyro import BamConfig, ObjectiveConfig, diagnostics
from bam_pyro.diagnostics import chain_seeds, seeded_chains
from experiments.gat.uncertainty import attention_diagnostics
from experiments.nmt.multi30k import make_batch
from experiments.nmt.attention import SITE, posterior_chains
from experiments.vqa.uncertainty import guided_attention_chains
from models.gat import build_node_classifier
from models.nmt import NetworkSizes, build_translator
from models.vqa import McanSizes, build_vqa_model
from tests.conftest import random_graph
from tests.test_latent_alignment import build as build_alignment_model

WC = BamConfig("wc", k=5.0, beta=1e-2, d_mid=4)
SEED = 7


def random_numbers() -> tuple:
    """One number from each RNG a draw may use: torch's, NumPy's and Python's."""
    return torch.rand(()).item(), np.random.rand(), random.random()


def test_chain_c_is_seeded_with_the_run_seed_plus_c_and_the_callers_rng_goes_on_untouched():
    assert chain_seeds(SEED, 3) == [7, 8, 9]
    with pytest.raises(ValueError, match="chains must be a whole number >= 1"):
        chain_seeds(SEED, 0)
    pyro.set_rng_seed(0)
    chains = seeded_chains(random_numbers, SEED, chains=3)
    after = random_numbers()
    for seed, numbers in zip(chain_seeds(SEED, 3), chains):
        pyro.set_rng_seed(seed)
        assert numbers == random_numbers()
    pyro.set_rng_seed(0)
    assert after == random_numbers()  # as if no chain had been drawn


@pytest.fixture
def seeds_used(monkeypatch) -> list[list[int]]:
    """The chain seeds every call of the pipeline asked for."""
    used = []

    def recording(seed: int, chains: int) -> list[int]:
        used.append(chain_seeds(seed, chains))
        return used[-1]

    monkeypatch.setattr(diagnostics, "chain_seeds", recording)
    return used


def test_graph_diagnostics_draw_through_the_pipeline(seeds_used, tmp_path):
    x, edge_index, _ = random_graph(num_nodes=12, num_edges=60)
    torch.manual_seed(0)
    model = build_node_classifier(12, 3, WC, ObjectiveConfig(), heads=2, hidden=8, dropout=0.0)
    data = SimpleNamespace(x=x, edge_index=edge_index, num_nodes=12, test_mask=torch.ones(12, dtype=torch.bool))
    settings = SimpleNamespace(seed=SEED, chains=2, samples=2, chunk=100, diag_nodes=1)
    attention_diagnostics(model, data, settings, tmp_path)
    assert seeds_used == [[7, 8]] and (tmp_path / "diagnostics" / "attention-diagnostics.json").is_file()


def test_vqa_diagnostics_draw_through_the_pipeline(seeds_used):
    sizes = McanSizes(hidden=16, heads=2, encoder_layers=1, decoder_layers=1, embedding=8, features=16, grid=4, dropout=0.1)
    torch.manual_seed(0)
    model = build_vqa_model(10, 4, WC, sizes=sizes).eval()
    words = torch.tensor([[3, 4, 5], [6, 7, 0]])
    with torch.no_grad():
        features = model.network.image_features(torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8))
    settings = SimpleNamespace(seed=SEED, chains=2, diag_draws=4, chunk=4)
    posterior, prior = guided_attention_chains(model, (words, None, features), settings)
    assert seeds_used == [[7, 8]] and len(posterior) == len(prior) == 2


@pytest.mark.parametrize("variant", ["bam", "va-sample", "exact"])
def test_translation_diagnostics_draw_through_the_pipeline(seeds_used, variant):
    torch.manual_seed(0)
    if variant == "bam":
        sizes = NetworkSizes(embedding=8, encoder=6, decoder=10, attention=5, layers=1, dropout=0.0)
        model = build_translator(16, sizes, WC, ObjectiveConfig(reduction="sum")).eval()
    else:
        model = build_alignment_model(variant).eval()
    batch = make_batch([np.array([4, 5, 6]), np.array([7, 8])], [np.array([5, 6]), np.array([4, 7, 8])])
    posterior, prior = posterior_chains(model, batch, draws=3, seed=SEED, chains=2)
    assert seeds_used == [[7, 8]] and len(posterior) == len(prior) == 2
    again, _ = posterior_chains(model, batch, draws=3, seed=SEED + 1, chains=1)
    np.testing.assert_array_equal(again[0][SITE], posterior[1][SITE])  # chain 1 of seed 7 is chain 0 of seed 8
