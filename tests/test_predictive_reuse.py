"""Attention draws summed in bags (bam_pyro.pyg.draw_aggregation) give the draws of PyG's propagate."""

import pyro
import pytest
import torch
from pyro.infer import Predictive
from torch_geometric.utils import scatter

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.predictive import attention_site_names, predictive_draws
from bam_pyro.pyg import set_bag_draws
from bam_pyro.pyg.draw_aggregation import BAG_ROWS, aggregate_draws, aggregates_in_bags
from models.gat import build_node_classifier

N, F, C = 12, 5, 3


@pytest.fixture(scope="module")
def graph():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, F, generator=g)
    edge_index = torch.randint(0, N - 2, (2, 30), generator=g)  # the last two nodes have no edges
    return x, edge_index


def propagated(weights, values, edge_index, num_targets):
    """What PyG's propagate sums: messages values_j * weights scattered onto the targets."""
    source, target = edge_index
    return scatter(values.index_select(-3, source) * weights.unsqueeze(-1), target, dim=-3, dim_size=num_targets)


@pytest.mark.parametrize("values_lead", [(), (4, 1), (1,)])
def test_bags_sum_what_propagate_sums(values_lead):
    g = torch.Generator().manual_seed(1)
    sources, targets, heads, channels = 7, 5, 3, 4
    edge_index = torch.stack([torch.randint(0, sources, (20,), generator=g), torch.randint(0, targets - 1, (20,), generator=g)])
    weights = torch.rand(4, 1, 20, heads, generator=g)
    values = torch.randn(*values_lead, sources, heads, channels, generator=g)
    out = aggregate_draws(weights, values, edge_index, targets)
    expected = propagated(weights, values, edge_index, targets)
    assert out.shape == expected.shape == (4, 1, targets, heads, channels)
    assert torch.allclose(out, expected, atol=1e-6)
    assert (out[..., targets - 1, :, :] == 0).all()  # a target without edges sums nothing


def test_bags_in_groups_sum_what_one_group_sums(monkeypatch):
    g = torch.Generator().manual_seed(2)
    edge_index = torch.randint(0, 6, (2, 9), generator=g)
    weights, values = torch.rand(5, 9, 2, generator=g), torch.randn(5, 6, 2, 3, generator=g)
    whole = aggregate_draws(weights, values, edge_index, 6)
    monkeypatch.setattr("bam_pyro.pyg.draw_aggregation.BAG_ROWS", 2 * 9 * 2)  # two draws per call, the last alone
    assert torch.allclose(aggregate_draws(weights, values, edge_index, 6), whole, atol=1e-6)
    assert BAG_ROWS >= 2**20


def test_bags_serve_draws_only():
    weights, values = torch.rand(3, 4, 2), torch.randn(5, 2, 3)
    assert aggregates_in_bags(weights, values)
    assert not aggregates_in_bags(weights[0], values)  # no draw dimensions: propagate
    assert not aggregates_in_bags(weights.requires_grad_(), values)  # training with vectorized particles
    with torch.no_grad():
        assert aggregates_in_bags(weights, values)
    assert not aggregates_in_bags(weights.detach().double(), values)


def classifier():
    torch.manual_seed(0)
    return build_node_classifier(F, C, BamConfig("wc", k=2.0), ObjectiveConfig(), heads=2, hidden=4).eval()


def draws_both_ways(draw):
    """``draw()`` with bags and with propagate, from the same seed."""
    runs = {}
    for bags in (False, True):
        model = set_bag_draws(classifier(), bags)
        pyro.set_rng_seed(3)
        runs[bags] = draw(model)
    return runs[False], runs[True]


@pytest.mark.parametrize("chunk_size", [7, 3])
def test_predictive_draws_are_those_of_propagate(graph, chunk_size):
    x, edge_index = graph
    old, new = draws_both_ways(lambda model: predictive_draws(
        model, (x, edge_index), 7, layers=attention_site_names(model), chunk_size=chunk_size, with_prior=True))
    assert new.probs.shape == (7, N, C)
    assert torch.allclose(new.probs, old.probs, atol=1e-6)
    for name in old.attention:
        assert torch.allclose(new.attention[name], old.attention[name], atol=1e-6)
        assert torch.allclose(new.prior_location[name], old.prior_location[name], atol=1e-6)
    assert (new.probs[0] != new.probs[1]).any()  # draws, not copies of one


def test_predictive_with_the_guide_gives_the_same_sites_and_log_probs(graph):
    x, edge_index = graph

    def trace(model):
        return Predictive(AttentionGuide(model.model), num_samples=5, parallel=True).get_vectorized_trace(x, edge_index)

    old, new = draws_both_ways(trace)
    for name in ("conv1.attention", "conv2.attention"):
        assert torch.allclose(new.nodes[name]["value"], old.nodes[name]["value"], rtol=1e-5)
        log_p = [t.nodes[name]["fn"].log_prob(t.nodes[name]["value"]) for t in (old, new)]
        assert log_p[1].shape == (5, 1) and torch.allclose(log_p[1], log_p[0], rtol=1e-5)
    assert torch.equal(new.nodes["y"]["value"], old.nodes["y"]["value"])


def test_point_prediction_and_training_take_propagate(graph, monkeypatch):
    x, edge_index = graph

    def refuse(*args):
        raise AssertionError("bags outside draws")

    monkeypatch.setattr("bam_pyro.pyg.edge_attention.aggregate_draws", refuse)
    model = classifier()
    with torch.no_grad():
        model.network(x, edge_index)
    model.train()
    y = torch.zeros(N, dtype=torch.long)
    pyro.infer.TraceMeanField_ELBO().differentiable_loss(model.model, AttentionGuide(model.model), x, edge_index, y=y).backward()

