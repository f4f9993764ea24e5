"""The model as Pyro users drive it: ``pyro.infer.SVI`` with a ``pyro.optim`` optimizer and the
param store, the torch-optimizer path beside it, pickling, and other latent variables whose guide
is an autoguide, combined with the attention guide in one network pass per step."""

import io
import math
import pickle

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoNormalMessenger
from pyro.optim import ClippedAdam

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.elbo import AttentionMeanFieldELBO
from bam_pyro.pyg import NodeClassifier
from models.gat import GAT, build_node_classifier

from .conftest import random_graph

WC = BamConfig("wc", k=10.0)
STEPS = 60


@pytest.fixture(autouse=True)
def _fresh_param_store_one_thread(_seed_and_threads):
    torch.set_num_threads(1)  # training loops of tiny ops: threads only contend
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def small_model(seed: int = 0, config: BamConfig = WC) -> NodeClassifier:
    torch.manual_seed(seed)
    return build_node_classifier(12, 3, config, ObjectiveConfig(), heads=2, hidden=8, dropout=0.0)


def mean_loss(losses: list[float], first: bool) -> float:
    window = losses[:10] if first else losses[-10:]
    return sum(window) / len(window)


def training_nll(model: NodeClassifier, x, edge_index, y) -> float:
    """Cross-entropy of the posterior-mean prediction (eval mode) on the labelled nodes."""
    model.eval()
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model.network(x, edge_index), y).item()
    model.train()
    return nll


def test_pyro_svi_with_pyro_optim_trains_the_network():
    x, edge_index, y = random_graph()
    model = small_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    nll = training_nll(model, x, edge_index, y)
    svi = SVI(model.model, AttentionGuide(model.model), ClippedAdam({"lr": 0.05}), AttentionMeanFieldELBO())
    pyro.set_rng_seed(0)
    losses = [svi.step(x, edge_index, y=y) for _ in range(STEPS)]
    assert mean_loss(losses, first=False) < 0.9 * mean_loss(losses, first=True)
    assert training_nll(model, x, edge_index, y) < 0.8 * nll
    for name, param in model.named_parameters():
        assert not torch.equal(param, before[name]), f"{name} was not trained"
    # the param store holds the network's own tensors, under pyro.module's names
    store = pyro.get_param_store()
    assert set(store.keys()) == {f"bam$$${name}" for name, _ in model.named_parameters()}
    assert all(store[f"bam$$${name}"] is param for name, param in model.named_parameters())


def test_torch_optimizer_and_pyro_train_the_same_tensors():
    """The torch path (SVITrainer's) is unchanged: a torch.optim step on model.parameters() moves
    what the param store holds, since both are the same tensors."""
    x, edge_index, y = random_graph()
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loss = AttentionMeanFieldELBO().differentiable_loss(model.model, AttentionGuide(model.model), x, edge_index, y=y)
    loss.backward()
    optimizer.step()
    weight = pyro.get_param_store()["bam$$$network.conv1.lin.weight"]
    assert weight is model.network.conv1.lin.weight and weight.grad is not None


def test_a_later_model_of_the_same_name_is_the_one_trained():
    """pyro.module keeps an existing entry of the same name, and SVI would train an earlier
    model's tensors while the new one computes with its own. Here the store follows the model."""
    x, edge_index, y = random_graph()
    earlier = small_model(seed=0)
    SVI(earlier.model, AttentionGuide(earlier.model), ClippedAdam({"lr": 0.02}), AttentionMeanFieldELBO()).step(x, edge_index, y=y)
    model = small_model(seed=1)
    weight = model.network.conv1.lin.weight.detach().clone()
    svi = SVI(model.model, AttentionGuide(model.model), ClippedAdam({"lr": 0.02}), AttentionMeanFieldELBO())
    svi.step(x, edge_index, y=y)
    assert not torch.equal(model.network.conv1.lin.weight, weight)
    assert pyro.get_param_store()["bam$$$network.conv1.lin.weight"] is model.network.conv1.lin.weight


def test_registered_model_still_pickles_and_predicts():
    x, edge_index, y = random_graph()
    model = small_model()
    svi = SVI(model.model, AttentionGuide(model.model), ClippedAdam({"lr": 0.02}), AttentionMeanFieldELBO())
    svi.step(x, edge_index, y=y)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the param store's weak references on the parameters do not pickle
    copy = pickle.loads(pickle.dumps(model))
    assert torch.equal(copy.network.conv1.lin.weight, model.network.conv1.lin.weight)
    svi.step(x, edge_index, y=y)  # and the original trains on
    model.eval()
    draws = Predictive(model.model, guide=AttentionGuide(model.model), num_samples=4, parallel=True)(x, edge_index)
    assert draws["y"].shape == (4, x.size(0)) and draws["conv1.attention"].shape[0] == 4


class ScaledNodeClassifier(NodeClassifier):
    """Node classification with one more latent variable: a global temperature of the logits."""

    def likelihood(self, logits, y=None, nodes=None):
        scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
        super().likelihood(logits * scale, y, nodes)


class AttentionAndAutoNormal(AttentionGuide, AutoNormalMessenger):
    """q(S | Phi) at the attention sites, a mean-field Normal at every other latent site."""


def scaled_model() -> ScaledNodeClassifier:
    torch.manual_seed(0)
    return ScaledNodeClassifier(GAT(12, 3, WC, hidden=8, heads=2, dropout=0.0), ObjectiveConfig())


def test_autoguide_for_the_other_latent_sites_in_one_pass_per_step():
    x, edge_index, y = random_graph()
    model = scaled_model()
    passes = []
    model.network.register_forward_hook(lambda *_: passes.append(1))
    guide = AttentionAndAutoNormal(model.model)
    svi = SVI(model.model, guide, ClippedAdam({"lr": 0.05}), AttentionMeanFieldELBO())
    pyro.set_rng_seed(0)
    losses = [svi.step(x, edge_index, y=y) for _ in range(STEPS)]
    assert len(passes) == STEPS  # one network pass per step serves model and guide
    assert mean_loss(losses, first=False) < 0.9 * mean_loss(losses, first=True)

    guide(x, edge_index, y=y)  # the ELBO lets go of each step's trace: one more pass to look at one
    model_trace, guide_trace = guide.get_traces()
    posterior = guide_trace.nodes["scale"]["fn"]  # the autoguide's: a Normal mapped onto (0, inf)
    assert isinstance(posterior, dist.TransformedDistribution) and isinstance(posterior.base_dist, dist.Normal)
    assert torch.equal(posterior.base_dist.loc, guide.locs.scale)
    assert pyro.get_param_store()["locs.scale"] is guide.locs.scale_unconstrained
    assert guide.locs.scale.item() != 0.0  # initialized at the prior's mean of log scale (0), then trained
    for name in ("conv1.attention", "conv2.attention"):  # attention: q(S | Phi), the model's prior beside it
        phi = guide_trace.nodes[name]["infer"]["bam_attention"].phi
        assert torch.allclose(guide_trace.nodes[name]["fn"].mean, phi.exp(), rtol=1e-4)
        assert guide_trace.nodes[name]["fn"] is not model_trace.nodes[name]["fn"]

    # posterior prediction: the unobserved labels come from the model, never from the autoguide
    model.eval()
    draws = Predictive(model.model, guide=guide, num_samples=3)(x, edge_index)
    assert draws["y"].shape == (3, x.size(0)) and draws["scale"].shape[0] == 3


def test_attention_guide_alone_draws_other_latent_sites_from_the_model():
    x, edge_index, y = random_graph()
    model = scaled_model()
    guide = AttentionGuide(model.model)
    TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, edge_index, y=y)
    model_trace, guide_trace = guide.get_traces()
    assert isinstance(guide_trace.nodes["scale"]["fn"], dist.LogNormal)
    assert guide_trace.nodes["scale"]["fn"] is model_trace.nodes["scale"]["fn"]  # the prior itself


def test_an_annealed_model_refuses_a_training_pass_without_its_step():
    """The loop passes the annealing step t (Pyro's SVI cannot know it): an annealed model trained
    without it would train another objective, so it refuses, naming the argument. Prediction passes
    (no gradients, or eval mode) and a model without annealing need no step."""
    x, edge_index, y = random_graph()
    torch.manual_seed(0)
    annealed = build_node_classifier(12, 3, WC, ObjectiveConfig(anneal_rate=0.1), heads=2, hidden=8, dropout=0.0).train()
    with pytest.raises(ValueError, match=r"anneals its KL weight \(anneal_rate=0.1\): pass the training step, model\(..., step=t\)"):
        annealed.model(x, edge_index, y=y)
    scales = [pyro.poutine.trace(annealed.model).get_trace(x, edge_index, y=y, step=t).nodes["conv2.attention"]["scale"]
              for t in (0, 4)]
    assert scales[1] / scales[0] == pytest.approx((1 / (1 + math.exp(-0.4))) / 0.5)
    small_model().train().model(x, edge_index, y=y)  # no annealing: no step
    with torch.no_grad():
        annealed.model(x, edge_index, y=y)
    annealed.eval().model(x, edge_index, y=y)
    assert annealed.kl_scale(None) == 1.0
