"""Posterior predictive draws with pyro.infer.Predictive on a small random graph."""

import pyro
import pytest
import torch
from pyro.infer import Predictive

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.guide import AttentionGuide
from bam_pyro.predictive import attention_site_names, predictive_draws, softmax_probs
from models.gat import build_node_classifier

N, F, C, E = 12, 5, 3, 30


@pytest.fixture(scope="module")
def graph():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, F, generator=g)
    edge_index = torch.randint(0, N, (2, E), generator=g)
    return x, edge_index


def classifier(variant: str, **config):
    torch.manual_seed(0)
    return build_node_classifier(F, C, BamConfig(variant=variant, **config), ObjectiveConfig(), heads=2, hidden=4)


def num_entries(edge_index):
    loops = (edge_index[0] == edge_index[1]).sum()
    return edge_index.shape[1] - int(loops) + N  # GAT replaces self-loops by one per node


def test_wc_draws_shapes_and_variation(graph):
    x, edge_index = graph
    model = classifier("wc", k=2.0).train()
    layers = attention_site_names(model)
    assert layers == ["conv1.attention", "conv2.attention"]
    draws = predictive_draws(model, (x, edge_index), 7, layers=layers, chunk_size=3)
    assert draws.probs.shape == (7, N, C)
    assert torch.allclose(draws.probs.sum(-1), torch.ones(7, N), atol=1e-5)
    entries = num_entries(edge_index)
    assert draws.attention["conv1.attention"].shape == (7, entries, 2)
    assert draws.attention["conv2.attention"].shape == (7, entries, 1)
    assert draws.probs.std(0).max() > 1e-4  # attention noise differs per draw, also across chunks
    assert (draws.probs[0] != draws.probs[3]).any()
    assert model.training and model.record_attention is False  # state restored


def test_attention_weights_are_normalized_per_target(graph):
    x, edge_index = graph
    model = classifier("wc")
    draws = predictive_draws(model, (x, edge_index), 4, layers=["conv1.attention"])
    from torch_geometric.utils import add_self_loops, remove_self_loops

    target = add_self_loops(remove_self_loops(edge_index)[0], num_nodes=N)[0][1]
    w = draws.attention["conv1.attention"]
    totals = torch.zeros(4, N, 2).index_add_(1, target, w)
    assert torch.allclose(totals, torch.ones(4, N, 2), atol=1e-5)


def test_select_attention_applies_per_chunk(graph):
    x, edge_index = graph
    draws = predictive_draws(classifier("wc"), (x, edge_index), 5, layers=["conv2.attention"],
                             select_attention=lambda w: w[:, :3], chunk_size=2)
    assert draws.attention["conv2.attention"].shape == (5, 3, 1)


def test_soft_is_deterministic_without_dropout_and_varies_with_mc_dropout(graph):
    x, edge_index = graph
    model = classifier("soft")
    fixed = predictive_draws(model, (x, edge_index), 4)
    assert torch.equal(fixed.probs[0], fixed.probs[3])
    with torch.no_grad():
        model.eval()
        point = model.network(x, edge_index).softmax(-1)
    assert torch.allclose(fixed.probs[0], point, atol=1e-6)  # eval mode = posterior-mean rule
    mc = predictive_draws(model, (x, edge_index), 6, dropout=True, chunk_size=4)
    assert mc.probs.shape == (6, N, C)
    assert (mc.probs[0] != mc.probs[1]).any() and (mc.probs[4] != mc.probs[5]).any()


def test_nokl_noise_is_drawn_per_sample(graph):
    x, edge_index = graph
    draws = predictive_draws(classifier("nokl", k=1.0), (x, edge_index), 4)
    assert (draws.probs[0] != draws.probs[1]).any()


def test_prior_location_is_the_contextual_psi(graph):
    x, edge_index = graph
    model = classifier("wc", beta=2.0)
    draws = predictive_draws(model, (x, edge_index), 3, layers=["conv1.attention", "conv2.attention"], with_prior=True)
    from torch_geometric.utils import add_self_loops, remove_self_loops

    target = add_self_loops(remove_self_loops(edge_index)[0], num_nodes=N)[0][1]
    psi = draws.prior_location["conv2.attention"]
    assert psi.shape == draws.attention["conv2.attention"].shape
    totals = torch.zeros(3, N, 1).index_add_(1, target, psi)
    assert torch.allclose(totals, torch.ones(3, N, 1), atol=1e-5)  # alpha / beta = Psi, on the simplex
    assert not torch.allclose(psi[0], psi[1])  # layer 2's prior depends on layer 1's draw
    fixed = predictive_draws(classifier("wf", alpha=3.0, beta=2.0), (x, edge_index), 2, layers=["conv1.attention"], with_prior=True)
    assert torch.allclose(fixed.prior_location["conv1.attention"], torch.tensor(1.5))


def test_bad_arguments(graph):
    x, edge_index = graph
    model = classifier("wc")
    with pytest.raises(ValueError, match="unknown attention sites"):
        predictive_draws(model, (x, edge_index), 2, layers=["conv9.attention"])
    with pytest.raises(ValueError, match=">= 1"):
        predictive_draws(model, (x, edge_index), 0)
    with pytest.raises(ValueError, match="sum to one"):
        predictive_draws(model, (x, edge_index), 2, probs_fn=lambda logits: logits.exp())


def test_a_model_of_integer_inputs_draws_its_noise_per_draw_too():
    """Token ids and masks cannot carry the draws' dimension: without a floating-point input,
    each draw of a noise that is not a Pyro site (nokl, MC dropout) must still be its own."""
    import pyro.distributions as dist

    from bam_pyro import BamModel, MultiHeadBayesianAttention

    class Tokens(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embedding = torch.nn.Embedding(10, 8)
            self.attention = MultiHeadBayesianAttention(8, 2, config, dropout=0.5)
            self.head = torch.nn.Linear(8, C)

        def forward(self, ids, valid):
            x = self.embedding(ids)
            return self.head(self.attention(x, x, x, valid_keys=valid)[0].mean(-2))

    class Classifier(BamModel):
        def likelihood(self, logits, y=None):
            self.observe("y", dist.Categorical(logits=self.align_to_plate(logits, ndim=2)), y)

    ids = torch.randint(0, 10, (3, 5))
    valid = torch.ones(3, 5, dtype=torch.bool)
    for config, dropout in ((BamConfig("nokl", k=1.0), False), (BamConfig("soft"), True)):
        torch.manual_seed(0)
        model = Classifier(Tokens(config), ObjectiveConfig())
        draws = predictive_draws(model, (ids, valid), 6, dropout=dropout, chunk_size=6)
        assert draws.probs.shape == (6, 3, C)
        assert draws.probs.std(0).min() > 0, config.variant  # every draw differs from the others



def test_targets_are_drawn_by_the_probe_passes_only(graph, monkeypatch):
    """The draws keep class probabilities; a label drawn for every node and draw would be waste."""
    x, edge_index = graph
    sampled = []
    draw = torch.distributions.Categorical.sample

    def recording(self, *args, **kwargs):
        sampled.append(tuple(self.batch_shape))
        return draw(self, *args, **kwargs)

    monkeypatch.setattr(torch.distributions.Categorical, "sample", recording)
    draws = predictive_draws(classifier("wc", k=2.0), (x, edge_index), 6, chunk_size=4)
    assert draws.probs.shape == (6, N, C) and draws.probs.std(0).max() > 1e-4
    assert sampled == [(N,)] * 4  # two plate-less probes per chunk, no [draws, N] labels


def test_a_chunk_draws_what_it_drew_with_its_labels(graph):
    """The labels come last in a pass: skipping their draw leaves a chunk's draws as they were."""
    x, edge_index = graph
    model = classifier("wc", k=2.0).eval()

    def program(*args):
        pyro.deterministic("probs", softmax_probs(model.model(*args)), event_dim=2)

    pyro.set_rng_seed(3)
    with torch.no_grad():
        trace = Predictive(AttentionGuide(program), num_samples=6, parallel=True).get_vectorized_trace(x, edge_index)
    assert trace.nodes["y"]["value"].shape == (6, N)  # drawn there
    pyro.set_rng_seed(3)
    drawn = predictive_draws(model, (x, edge_index), 6)
    torch.testing.assert_close(drawn.probs, trace.nodes["probs"]["value"].reshape(6, N, C))
