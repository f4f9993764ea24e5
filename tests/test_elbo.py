"""The Pyro plumbing: TraceMeanField_ELBO takes the analytic KL path and its loss equals
``-loglik + lambda * KL`` computed by hand; one network forward pass per SVI step; the model
runs alone; annealing and the mean reduction scale the KL as documented."""

import math

import pyro
import pytest
import torch
from pyro.infer import Predictive, TraceMeanField_ELBO
from torch.distributions import Gamma
from torch.distributions import kl as torch_kl

import pyro.distributions as dist

from bam_pyro import BamConfig, BamModel, ObjectiveConfig
from bam_pyro.distributions import MeanWeibull
from bam_pyro.elbo import AttentionMeanFieldELBO
from bam_pyro.kl import summed
from bam_pyro.kl import summed_kl_mean_weibull_gamma
from bam_pyro import AttentionGuide
from models.gat import build_node_classifier

from .conftest import random_graph

EULER = 0.5772156649015329


def weibull_gamma_kl_by_hand(phi, k, log_psi, beta):
    """The paper's closed form in float64, with lam = exp(phi)/Gamma(1+1/k), alpha = Psi*beta."""
    phi, log_psi = phi.double(), log_psi.double()
    lam = torch.exp(phi - math.lgamma(1 + 1 / k))
    alpha = torch.exp(log_psi + math.log(beta)).clamp_min(1e-30)
    return (EULER * alpha / k - alpha * torch.log(lam) + math.log(k) + beta * lam * math.gamma(1 + 1 / k)
            - EULER - 1 - alpha * math.log(beta) + torch.lgamma(alpha))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_is_negative_loglik_plus_annealed_kl_by_hand(reduction):
    x, edge_index, y = random_graph()
    objective = ObjectiveConfig(reduction=reduction, kl_weight=0.3, anneal_rate=0.1)
    model = build_node_classifier(x.size(1), 3, BamConfig("wc", k=1.5, beta=0.5), objective).eval()
    guide = AttentionGuide(model.model)
    nodes = torch.arange(10)

    pyro.set_rng_seed(3)
    loss = TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, edge_index, y=y, nodes=nodes, step=7)

    pyro.set_rng_seed(3)  # the same draws again, recorded in a trace
    guide(x, edge_index, y=y, nodes=nodes, step=7)
    model_trace, guide_trace = guide.get_traces()
    lam_t = 1 / (1 + math.exp(-7 * 0.1))
    kl_total = 0.0
    for name in ("conv1.attention", "conv2.attention"):
        q = guide_trace.nodes[name]["fn"].base_dist
        p = model_trace.nodes[name]["fn"].base_dist
        phi = torch.log(q.scale) + math.lgamma(1 + 1 / 1.5)
        log_psi = torch.log(p.concentration) - math.log(0.5)
        kl = weibull_gamma_kl_by_hand(phi, 1.5, log_psi, 0.5)
        kl_total += kl.sum() / (kl.numel() * 2) if reduction == "mean" else kl.sum()
    logits = model_trace.nodes["y"]["fn"].logits
    assert logits.shape == (10, 3)
    loglik = torch.log_softmax(logits, -1).gather(-1, y[nodes, None]).squeeze(-1).double()
    loglik = loglik.mean() if reduction == "mean" else loglik.sum()
    expected = -loglik + lam_t * 0.3 * kl_total
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_analytic_kl_path_is_taken_not_the_monte_carlo_fallback(monkeypatch):
    """Each site's KL comes from the summed closed form; it equals the entry-wise closed form
    masked and summed (the generic route); without either, Pyro's Monte Carlo estimate differs."""
    x, edge_index, y = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("wc"), ObjectiveConfig(reduction="sum")).eval()
    guide = AttentionGuide(model.model)
    evaluated = []

    def counting_kl(q, p, mask, event_dim):
        evaluated.append(tuple(q.batch_shape))
        return summed_kl_mean_weibull_gamma(q, p, mask, event_dim)

    def loss():
        monkeypatch.setattr(torch_kl, "_KL_MEMOIZE", {})
        pyro.set_rng_seed(0)
        return TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, edge_index, y=y).item()

    monkeypatch.setattr(summed, "summed_kl_mean_weibull_gamma", counting_kl)
    analytic = loss()
    assert len(evaluated) == 2  # once per attention site, over all its entries
    edges = int((edge_index[0] != edge_index[1]).sum()) + x.size(0)  # self loops: one per node
    assert evaluated[0] == (edges, 8)  # every edge and head

    monkeypatch.setattr(summed, "summed_kl_mean_weibull_gamma", summed.entrywise_summed_kl)
    assert loss() == pytest.approx(analytic, rel=1e-5)  # entry-wise KL, summed

    # Without the registrations Pyro silently falls back to a Monte Carlo estimate: the loss changes.
    monkeypatch.delitem(torch_kl._KL_REGISTRY, (MeanWeibull, Gamma))
    assert abs(analytic - loss()) > 1.0


def test_one_network_forward_pass_per_svi_step():
    x, edge_index, y = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("wc"), ObjectiveConfig())
    guide = AttentionGuide(model.model)
    elbo = TraceMeanField_ELBO(max_plate_nesting=1)
    calls = []
    model.network.register_forward_hook(lambda *_: calls.append(1))
    model.network.conv1.register_forward_hook(lambda *_: calls.append("conv1"))
    loss = elbo.differentiable_loss(model.model, guide, x, edge_index, y=y)
    loss.backward()
    assert calls.count(1) == 1 and calls.count("conv1") == 1


def test_guide_and_model_share_dropout_masks():
    """The likelihood is evaluated on the very tensors the guide's pass produced."""
    x, edge_index, y = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("wc"), ObjectiveConfig()).train()
    guide = AttentionGuide(model.model)
    guide(x, edge_index, y=y)
    model_trace, guide_trace = guide.get_traces()
    s = guide_trace.nodes["conv1.attention"]["value"]
    assert model_trace.nodes["conv1.attention"]["value"] is s
    assert model_trace.nodes["conv1.attention"]["fn"] is not guide_trace.nodes["conv1.attention"]["fn"]


def test_model_runs_alone_sampling_the_prior():
    x, edge_index, y = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("lc", sigma_p=1.0), ObjectiveConfig()).eval()
    trace = pyro.poutine.trace(model.model).get_trace(x, edge_index)
    site = trace.nodes["conv1.attention"]
    assert type(site["fn"].base_dist).__name__ == "LogNormal"
    assert site["fn"].base_dist.scale.unique().tolist() == [1.0]  # the prior's sigma_p
    assert trace.nodes["y"]["value"].shape == (x.size(0),)
    prior_predictive = Predictive(model.model, num_samples=4)(x, edge_index)
    assert prior_predictive["y"].shape == (4, x.size(0))


def test_model_runs_alone_at_the_papers_widest_lognormal_prior():
    """Cora's lc preset, sigma_p = 1e15: the prior's draws over- and underflow to inf and 0, and
    the weights are still finite."""
    x, edge_index, _ = random_graph()
    config = BamConfig("lc", sigma_p=1e15, sigma_q=1e-15, d_mid=1)
    model = build_node_classifier(x.size(1), 3, config, ObjectiveConfig()).eval()
    model.record_attention = True
    trace = pyro.poutine.trace(model.model).get_trace(x, edge_index)
    assert torch.isinf(trace.nodes["conv1.attention"]["value"]).any()
    for name in ("conv1.attention", "conv2.attention"):
        assert torch.isfinite(trace.nodes[f"{name}.weights"]["value"]).all()
    assert torch.isfinite(trace.nodes["_RETURN"]["value"]).all()


def test_site_scale_is_annealing_times_weight_over_entries_and_sites():
    x, edge_index, y = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("wc"), ObjectiveConfig(kl_weight=2.0, anneal_rate=0.5))
    guide = AttentionGuide(model.model)
    guide(x, edge_index, y=y, step=3)
    model_trace, guide_trace = guide.get_traces()
    lam = 1 / (1 + math.exp(-1.5))
    for name, heads in (("conv1.attention", 8), ("conv2.attention", 1)):
        entries = guide_trace.nodes[name]["value"].shape[-2] * heads
        assert guide_trace.nodes[name]["scale"] == pytest.approx(2.0 * lam / (entries * 2))
        assert model_trace.nodes[name]["scale"] == guide_trace.nodes[name]["scale"]
    assert model_trace.nodes["y"]["scale"] == pytest.approx(1 / x.size(0))


def test_soft_and_nokl_have_no_latent_sites():
    x, edge_index, y = random_graph()
    for variant in ("soft", "nokl"):
        model = build_node_classifier(x.size(1), 3, BamConfig(variant), ObjectiveConfig())
        guide = AttentionGuide(model.model)
        guide(x, edge_index, y=y)
        model_trace, _ = guide.get_traces()
        latent = [n for n, s in model_trace.nodes.items() if s["type"] == "sample" and not s["is_observed"]]
        assert latent == []


class _Encoder(torch.nn.Module):
    def __init__(self, d_model=16, heads=4, layers=1, k=10.0):
        super().__init__()
        from bam_pyro import MultiHeadBayesianAttention

        config = BamConfig("wc", k=k, beta=1e-2, d_mid=5)
        self.attn = MultiHeadBayesianAttention(d_model, heads, config)
        self.upper = torch.nn.ModuleList(MultiHeadBayesianAttention(d_model, heads, config) for _ in range(layers - 1))
        self.head = torch.nn.Linear(d_model, 2)

    def forward(self, x, valid):
        h, _ = self.attn(x, x, x, valid_keys=valid)
        for layer in self.upper:
            h, _ = layer(h, h, h, valid_keys=valid)
        return self.head(h.mean(-2))


class _SequenceClassifier(BamModel):
    def likelihood(self, logits, y=None):
        self.observe("y", dist.Categorical(logits=self.align_to_plate(logits, 2)), y)


def test_batched_dense_attention_in_a_pyro_model_trains_and_predicts():
    x = torch.randn(8, 5, 16)
    valid = torch.ones(8, 5, dtype=torch.bool)
    valid[:3, 3:] = False
    y = torch.randint(0, 2, (8,))
    model = _SequenceClassifier(_Encoder(), ObjectiveConfig())
    guide = AttentionGuide(model.model)
    loss = TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, valid, y=y)
    loss.backward()
    assert model.network.attn.attention.prior_net.hidden_weight.grad.abs().sum() > 0  # the KL trains the prior
    model.eval()
    model.record_attention = True
    draws = Predictive(guide, num_samples=6, parallel=True, return_sites=["y", "attn.attention.weights"])(x, valid)
    assert draws["y"].shape == (6, 8)
    weights = draws["attn.attention.weights"]
    assert weights.shape == (6, 1, 8, 4, 5, 5)
    assert (weights[:, :, :3, ..., 3:] == 0).all()
    assert not torch.allclose(weights[0], weights[1])  # distinct posterior draws


def test_dense_site_scale_counts_only_the_valid_entries():
    """Under the mean reduction a site's KL is divided by its valid entries: padded keys do not count."""
    x = torch.randn(8, 5, 16)
    valid = torch.ones(8, 5, dtype=torch.bool)
    valid[:3, 3:] = False
    model = _SequenceClassifier(_Encoder(), ObjectiveConfig())
    guide = AttentionGuide(model.model)
    guide(x, valid, y=torch.randint(0, 2, (8,)))
    _, guide_trace = guide.get_traces()
    entries = 4 * 5 * (3 * 3 + 5 * 5)  # heads * queries * valid keys of 3 padded and 5 full sequences
    assert guide_trace.nodes["attn.attention"]["scale"] == pytest.approx(1 / entries)


def test_stacked_dense_layers_keep_sample_dims_out_of_the_site_event():
    """From the second layer on, the keys carry the sample dims of the draws below; they are batch
    dims of the site, not part of its event: Predictive runs vectorized, and vectorized particles
    weigh the KL as one particle does (q nearly deterministic at huge k)."""
    x, y = torch.randn(4, 5, 16), torch.randint(0, 2, (4,))
    model = _SequenceClassifier(_Encoder(layers=2, k=1e6), ObjectiveConfig()).eval()
    guide = AttentionGuide(model.model)
    draws = Predictive(guide, num_samples=3, parallel=True, return_sites=["y"])(x, None)
    assert draws["y"].shape == (3, 4)
    losses = [
        TraceMeanField_ELBO(num_particles=n, vectorize_particles=True, max_plate_nesting=1)
        .differentiable_loss(model.model, guide, x, None, y=y).item()
        for n in (1, 3)
    ]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_attention_elbo_equals_trace_mean_field_before_and_after_validation():
    """The trainer's default ELBO skips unused densities (and, after its first call, Pyro's
    validation) without changing the loss or its gradient."""
    x, edge_index, y = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("wc", k=2.0, beta=0.5), ObjectiveConfig()).eval()
    guide = AttentionGuide(model.model)
    lean = AttentionMeanFieldELBO()
    for call in range(2):
        losses, grads = [], []
        for elbo in (TraceMeanField_ELBO(), lean):
            pyro.set_rng_seed(call)
            loss = elbo.differentiable_loss(model.model, guide, x, edge_index, y=y)
            grads.append(torch.autograd.grad(loss, model.network.conv1.att_src)[0])
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)
        assert torch.allclose(grads[1], grads[0], rtol=1e-5, atol=1e-8)
    assert lean._validated


def test_attention_elbo_runs_pyros_checks_on_its_first_call_only(monkeypatch):
    """The checks of TraceMeanField_ELBO's own trace pass run on the first call: every sample site's
    shape (attention sites on the guide's side), model and guide matching, mean-field order."""
    from bam_pyro import elbo as elbo_module

    ran = []
    for name in ("check_model_guide_match", "check_if_enumerated", "_check_mean_field_requirement"):
        check = getattr(elbo_module, name)
        monkeypatch.setattr(elbo_module, name, lambda *a, _name=name, _check=check: (ran.append(_name), _check(*a)))
    check_shape = elbo_module.check_site_shape
    monkeypatch.setattr(elbo_module, "check_site_shape", lambda site, n: (ran.append(site["name"]), check_shape(site, n)))
    x, edge_index, y = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("wc"), ObjectiveConfig())
    guide = AttentionGuide(model.model)
    lean = AttentionMeanFieldELBO()
    lean.differentiable_loss(model.model, guide, x, edge_index, y=y)
    assert sorted(ran) == sorted([
        "check_model_guide_match", "check_if_enumerated", "_check_mean_field_requirement",
        "y", "conv1.attention", "conv2.attention",
    ])
    ran.clear()
    lean.differentiable_loss(model.model, guide, x, edge_index, y=y)
    assert ran == []


def test_the_guide_keeps_no_attention_map_once_the_loss_is_computed():
    """A GuideMessenger keeps its last trace (every site's Phi, S and prior) until its next call;
    the trainer's ELBO lets go of it, so no attention map outlives the step that needed it."""
    x, edge_index, y = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("wc", k=2.0, beta=0.5), ObjectiveConfig())
    guide = AttentionGuide(model.model)
    loss = AttentionMeanFieldELBO().differentiable_loss(model.model, guide, x, edge_index, y=y)
    assert torch.isfinite(loss) and not guide.trace.nodes
