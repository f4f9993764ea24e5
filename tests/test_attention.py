"""Bayesian attention: simplex rows, masks, the posterior-mean rule, the k -> inf limit, and
finite gradients of the whole SVI loss at the paper's extreme hyperparameters."""

import math
import pickle

import pyro.distributions as dist
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO

from bam_pyro import (
    BamConfig,
    BamModel,
    BayesianAttention,
    DenseKeys,
    MultiHeadBayesianAttention,
    ObjectiveConfig,
    attention_sampling,
    attention_sites,
    variational_distribution,
)
from bam_pyro.normalize import log_normalized
from experiments.gat.task import PRESETS, TASK
from bam_pyro import AttentionGuide
from bam_pyro.pyg import BayesianGATConv, EdgeKeys
from bam_pyro.pyg.gat_conv import (
    SparseEntriesCache,
    _dropped_copies_projection,
    input_dropout,
    per_head_dropout_projection,
    sparse_entries,
)
from models.gat import build_node_classifier

from .conftest import random_graph

VARIANTS = ["soft", "nokl", "lf", "lc", "wf", "wc"]


def dense_inputs(batch=2, heads=3, queries=4, keys=6, dim=5):
    scores = torch.randn(batch, heads, queries, keys) * 3
    key_vectors = torch.randn(batch, keys, heads, dim)
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    mask[0, ..., 4:] = False  # first example: last two keys are padding
    return scores, key_vectors, mask


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("sampling", [False, True])
def test_dense_rows_on_simplex_and_padding_gets_zero_weight(variant, sampling):
    scores, keys, mask = dense_inputs()
    layer = BayesianAttention(BamConfig(variant, k=1.0, sigma_q=1.0), num_heads=3, key_dim=5)
    with attention_sampling(sampling):
        w = layer(scores, keys, DenseKeys(mask))
    assert w.shape == scores.shape
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5)
    assert (w[0, ..., 4:] == 0).all()
    assert (w[0, ..., :4] > 0).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_sparse_rows_sum_to_one_over_each_neighbourhood(variant):
    num_nodes, heads = 7, 2
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 1, 2], [1, 1, 1, 2, 2, 3, 0, 0, 0]])
    scores = torch.randn(edge_index.size(1), heads)
    keys = torch.randn(num_nodes, heads, 4)
    layer = BayesianAttention(BamConfig(variant), heads, 4)
    with attention_sampling(True):
        w = layer(scores, keys, EdgeKeys(edge_index, num_nodes))
    sums = torch.zeros(num_nodes, heads).index_add_(0, edge_index[1], w)
    has_in_edges = torch.zeros(num_nodes, dtype=torch.bool)
    has_in_edges[edge_index[1]] = True
    assert torch.allclose(sums[has_in_edges], torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("variant", ["nokl", "lf", "lc", "wf", "wc"])
def test_eval_point_prediction_is_normalized_posterior_mean_and_equals_softmax(variant):
    scores, keys, mask = dense_inputs()
    layer = BayesianAttention(BamConfig(variant, k=1.0, sigma_q=0.7), 3, 5).eval()
    axis = DenseKeys(mask)
    w = layer(scores, keys, axis)
    mean_s = variational_distribution(log_normalized(axis, scores), layer.config).mean * mask
    assert torch.allclose(w, mean_s / mean_s.sum(-1, keepdim=True), atol=1e-6)
    soft = BayesianAttention(BamConfig("soft"), 3, 5)(scores, keys, axis)
    assert torch.allclose(w, soft, atol=1e-6)


@pytest.mark.parametrize("variant", ["lf", "wf"])
def test_q_mean_is_exp_phi_itself(variant):
    """E_q[S] = exp(Phi) before any normalization (LogNormal's loc is shifted by -sigma^2 / 2)."""
    phi = torch.randn(5, dtype=torch.float64)
    q = variational_distribution(phi, BamConfig(variant, k=1.5, sigma_q=0.7))
    assert torch.allclose(q.mean, phi.exp(), rtol=1e-12)


@pytest.mark.parametrize("variant, param", [("wf", dict(k=1e5)), ("lf", dict(sigma_q=1e-5))])
def test_samples_approach_softmax_as_noise_vanishes(variant, param):
    scores, keys, mask = dense_inputs()
    layer = BayesianAttention(BamConfig(variant, **param), 3, 5)
    soft = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    with attention_sampling(True):
        w = layer(scores, keys, DenseKeys(mask))
    assert torch.allclose(w, soft, atol=1e-3)
    noisy = BayesianAttention(BamConfig(variant, k=1.0, sigma_q=1.0), 3, 5)
    with attention_sampling(True):
        assert not torch.allclose(noisy(scores, keys, DenseKeys(mask)), soft, atol=1e-2)


def test_padding_changes_nothing_in_dense_module_outputs():
    torch.manual_seed(1)
    attn = MultiHeadBayesianAttention(d_model=12, num_heads=3, config=BamConfig("wc"), score="scaled_dot").eval()
    x = torch.randn(1, 5, 12)
    valid = torch.tensor([[True, True, True, False, False]])
    out, w = attn(x, x, x, valid_keys=valid)
    x2 = x.clone()
    x2[:, 3:] = torch.randn(1, 2, 12) * 100  # garbage in the padded positions
    out2, _ = attn(x2, x2, x2, valid_keys=valid)
    assert torch.allclose(out[:, :3], out2[:, :3], atol=1e-5)
    assert (w[..., 3:] == 0).all()


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "bilinear", "additive"])
def test_every_score_function_gives_attention_maps(score):
    attn = MultiHeadBayesianAttention(d_model=8, num_heads=2, config=BamConfig("wc"), score=score)
    out, w = attn(torch.randn(3, 4, 8), torch.randn(3, 6, 8), torch.randn(3, 6, 8))
    assert out.shape == (3, 4, 8) and w.shape == (3, 2, 4, 6)


@pytest.mark.parametrize("score", ["bilinear", "additive"])
def test_learned_score_weights_start_at_the_glorot_bound_of_one_head(score):
    """Per head, a [d, d] (or [d, hidden]) matrix: bound sqrt(6 / (d + d)), not that of a
    convolution kernel over the head stack (fans d * d), which is several times smaller."""
    heads, d = 4, 32
    attn = MultiHeadBayesianAttention(d_model=heads * d, num_heads=heads, config=BamConfig("wc"), score=score)
    bound = math.sqrt(6.0 / (2 * d))
    weights = [attn.score.weight] if score == "bilinear" else [attn.score.query_proj, attn.score.key_proj]
    for weight in weights:
        assert 0.95 * bound < weight.abs().max() <= bound


EXTREMES = [(dataset, variant, params) for dataset, by_variant in PRESETS.items() for variant, params in by_variant.items()]


@pytest.mark.parametrize("dataset, variant, params", EXTREMES, ids=[f"{d}-{v}" for d, v, _ in EXTREMES])
def test_svi_gradients_finite_at_paper_hyperparameters(dataset, variant, params):
    x, edge_index, y = random_graph()
    settings = TASK.settings_for(dataset, variant, 0, {})
    model = build_node_classifier(x.size(1), 3, settings.attention, ObjectiveConfig(kl_weight=10.0, anneal_rate=settings.anneal_rate))
    guide = AttentionGuide(model.model)
    for step in range(3):
        loss = TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, edge_index, y=y, step=step)
        model.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad


class _PooledClassifier(torch.nn.Module):
    def __init__(self, config: BamConfig):
        super().__init__()
        self.attention = MultiHeadBayesianAttention(8, 2, config)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x, valid):
        h, weights = self.attention(x, x, x, valid_keys=valid)
        self.weights = weights
        return self.head(h.mean(-2))


class _Classifier(BamModel):
    def likelihood(self, logits, y=None):
        self.observe("y", dist.Categorical(logits=self.align_to_plate(logits, ndim=2).float()), y)


@pytest.mark.parametrize("config", [BamConfig("wc", k=1000.0, beta=1e-6, d_mid=5), BamConfig("lc", sigma_q=1.0, d_mid=5)],
                         ids=["wc-k1000", "lc"])
def test_a_float16_model_trains_its_bayesian_attention_in_float32(config):
    """float16 cannot hold Phi's floor or the KL's terms (the loss was NaN, the gradients inf): the
    Bayesian part runs in float32 and the weights come back as float16 on the simplex."""
    torch.manual_seed(0)
    model = _Classifier(_PooledClassifier(config), ObjectiveConfig()).half()
    x = torch.randn(3, 5, 8).half()
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[1, 3:] = False
    loss = TraceMeanField_ELBO().differentiable_loss(model.model, AttentionGuide(model.model), x, valid,
                                                     y=torch.tensor([0, 1, 1]))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    weights = model.network.weights
    assert weights.dtype == torch.float16 and (weights[1, ..., 3:] == 0).all()
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(weights.shape[:-1]), atol=2e-3, rtol=0)


def test_contextual_prior_needs_keys():
    layer = BayesianAttention(BamConfig("wc"), 2, 4)
    from bam_pyro import attention_sites

    with attention_sites(), pytest.raises(ValueError, match="needs the keys"):
        layer(torch.randn(1, 2, 3, 3), None, DenseKeys())


@pytest.mark.parametrize("detach", [False, True])
def test_detach_prior_keys_stops_the_kl_gradient_at_the_keys_only(detach):
    """The KL of a site trains the prior network either way; it reaches the keys unless detached."""
    scores, keys, mask = dense_inputs()
    keys.requires_grad_()
    layer = BayesianAttention(BamConfig("wc", beta=1e-2, d_mid=2, detach_prior_keys=detach), num_heads=3, key_dim=5)
    axis = DenseKeys(mask)
    phi = log_normalized(axis, scores)
    prior = layer.prior(phi, keys, axis)
    q = variational_distribution(phi, layer.config)
    torch.distributions.kl_divergence(q, prior).masked_fill(~mask, 0.0).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.prior_net.parameters())
    assert (keys.grad is None) == detach
    if not detach:
        assert keys.grad.abs().sum() > 0


def prior_mean(layer, phi, keys, axis):
    """The Gamma prior's mean alpha / beta per entry: Psi, for ``gamma_shape="psi_beta"``."""
    prior = layer.prior(phi, keys, axis)
    return prior.concentration / prior.rate


def test_prior_over_all_nodes_is_one_distribution_over_the_graph_shared_by_every_target():
    _, edge_index, _ = random_graph(num_nodes=12, num_edges=40)
    keys = torch.randn(12, 3, 5)
    axis = EdgeKeys(edge_index, 12)
    phi = log_normalized(axis, torch.randn(40, 3))
    shared = BayesianAttention(BamConfig("wc", beta=0.5, d_mid=4, prior_scope="all_keys"), 3, 5)
    per_query = BayesianAttention(BamConfig("wc", beta=0.5, d_mid=4), 3, 5)
    per_query.prior_net.load_state_dict(shared.prior_net.state_dict())

    over_nodes = torch.softmax(shared.prior_net(keys), dim=0)  # [nodes, heads]
    torch.testing.assert_close(over_nodes.sum(0), torch.ones(3))
    torch.testing.assert_close(prior_mean(shared, phi, keys, axis), over_nodes[edge_index[0]])
    # the default renormalizes the same logits over each target's incoming edges instead
    psi = prior_mean(per_query, phi, keys, axis)
    torch.testing.assert_close(psi, over_nodes[edge_index[0]] / axis.key_sum(over_nodes[edge_index[0]]))
    assert not torch.allclose(psi, over_nodes[edge_index[0]])


def test_dense_prior_over_all_keys_skips_padding_and_differs_from_per_query_only_under_other_masks():
    scores, keys, padding = dense_inputs()
    shared = BayesianAttention(BamConfig("wc", beta=0.5, d_mid=4, prior_scope="all_keys"), 3, 5)
    per_query = BayesianAttention(BamConfig("wc", beta=0.5, d_mid=4), 3, 5)
    per_query.prior_net.load_state_dict(shared.prior_net.state_dict())
    axis = DenseKeys(padding)
    phi = log_normalized(axis, scores)
    psi = prior_mean(shared, phi, keys, axis)
    assert torch.equal(psi, psi[..., :1, :].expand_as(psi))  # the same for every query
    assert (psi[0, ..., 4:] < 1e-12).all()
    torch.testing.assert_close(psi.sum(-1), torch.ones(2, 3, 4))
    torch.testing.assert_close(psi, prior_mean(per_query, phi, keys, axis))

    causal = torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2)  # query i sees keys 0..i+2
    axis = DenseKeys(padding & causal)
    phi = log_normalized(axis, scores)
    psi = prior_mean(shared, phi, keys, axis)
    torch.testing.assert_close(psi.sum(-1), torch.ones(2, 3, 4))  # over every key some query sees
    rows = prior_mean(per_query, phi, keys, axis).masked_fill(~axis.mask, 0.0)
    torch.testing.assert_close(rows.sum(-1), torch.ones(2, 3, 4))  # over each query's own keys
    assert not torch.allclose(psi.masked_fill(~axis.mask, 0.0), rows)


def test_input_dropout_keeps_each_feature_with_probability_one_minus_p():
    x = torch.full((400, 500), 2.0)
    out = input_dropout(x, 0.6, training=True)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.4) < 0.01  # 200,000 draws: std of the mean 0.0011
    assert torch.allclose(out[kept], torch.tensor(2.0 / 0.4))  # inverted dropout: E[out] = x
    assert torch.equal(input_dropout(x, 0.6, training=False), x)
    assert x.eq(2.0).all()  # the input is not written to
    features = x.clone().requires_grad_()  # a gradient is wanted: torch's dropout
    input_dropout(features, 0.6, training=True).sum().backward()
    assert set(features.grad.unique().tolist()) <= {0.0, 2.5}


@pytest.mark.parametrize("path", ["sparse data", "dense data", "dense with gradient"])
def test_per_head_dropout_projection_draws_an_independent_mask_per_head(path):
    """Rows with one nonzero feature: each head's output is either 0 or that feature's column of
    W_h scaled by 1 / (1 - p), kept with probability 1 - p, independently across heads."""
    nodes, features, heads, channels, p = 3000, 40, 4, 3, 0.6
    cols = torch.randint(features, (nodes,))
    x = torch.zeros(nodes, features)
    x[torch.arange(nodes), cols] = 2.0
    if path == "dense with gradient":
        x.requires_grad_()
    weight = torch.randn(heads * channels, features, requires_grad=True)
    entries = None if path == "dense data" else sparse_entries(x, channels)
    assert (entries is None) == path.startswith("dense")
    out = per_head_dropout_projection(x, weight, heads, p, entries)  # [N, H, C]
    assert out.shape == (nodes, heads, channels)
    full = (2.0 / (1 - p)) * weight.detach().view(heads, channels, features)[:, :, cols].permute(2, 0, 1)
    kept = out.detach().ne(0).all(-1)  # [N, H]
    torch.testing.assert_close(out.detach()[kept], full[kept])
    assert (out.detach()[~kept] == 0).all()
    assert abs(kept.float().mean().item() - (1 - p)) < 0.02  # 12,000 draws: std 0.0045
    both = (kept[:, 0] & kept[:, 1]).float().mean().item()
    assert abs(both - (1 - p) ** 2) < 0.02  # independent heads: 0.16, a shared mask would give 0.4
    out.sum().backward()
    assert weight.grad.abs().sum() > 0
    x = x.expand(2, nodes, features)  # MC dropout: leading sample dimensions
    draws = per_head_dropout_projection(x, weight, heads, p, sparse_entries(x, channels))
    assert draws.shape == (2, nodes, heads, channels) and not torch.equal(draws[0], draws[1])


def test_dense_per_head_dropout_keeps_no_dropped_copies_for_backward_and_draws_the_same_masks():
    """Recomputing the H dropped copies in the backward pass replays the forward's RNG state: the
    same output and gradients as keeping them, while the graph holds less than one copy."""
    nodes, features, heads, channels, p = 300, 50, 8, 4, 0.6
    x = torch.randn(nodes, features, requires_grad=True)
    weight = torch.randn(heads * channels, features, requires_grad=True)
    saved = []

    def keep(tensor):
        saved.append(tensor.numel())
        return tensor

    torch.manual_seed(3)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = per_head_dropout_projection(x, weight, heads, p)
    assert sum(saved) < heads * nodes * features  # the copies alone would be H * N * F
    (out * torch.arange(channels)).sum().backward()
    grads = x.grad.clone(), weight.grad.clone()
    after = torch.rand(1)  # the global RNG stream moves on as if nothing were recomputed

    x.grad, weight.grad = None, None
    torch.manual_seed(3)
    kept = _dropped_copies_projection(x, weight.view(heads, channels, features), p)  # keeps the copies
    (kept * torch.arange(channels)).sum().backward()
    assert torch.equal(out, kept)
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], weight.grad)
    assert torch.equal(after, torch.rand(1))


@pytest.mark.parametrize("leading", [(), (3,)], ids=["one graph", "sample dims"])
@pytest.mark.parametrize("features", [50, 13], ids=["whole bytes", "a padded byte"])
def test_dense_data_dropout_keeps_its_masks_as_bits_and_matches_the_dropout_it_replaces(leading, features):
    """Data (no gradient wanted) takes each head's mask from ``uniform_`` and keeps the masks as
    bits for the backward pass: the output and weight gradient of the same masks kept as floats,
    one draw of the RNG stream (not two), and H * N * F / 8 bytes held."""
    nodes, heads, channels, p = 300, 8, 4, 0.6
    x = torch.randn(*leading, nodes, features)
    weight = torch.randn(heads * channels, features, requires_grad=True)
    probe = torch.randn(channels)
    saved = []

    def keep(tensor):
        saved.append((str(tensor.dtype), tensor.numel()))
        return tensor

    torch.manual_seed(3)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = per_head_dropout_projection(x, weight, heads, p)
    masks = heads * x.numel()
    assert sorted(saved) == sorted([("torch.float32", x.numel()), ("torch.uint8", heads * -(-x.numel() // 8))])
    (out * probe).sum().backward()
    after = torch.rand(1)

    torch.manual_seed(3)
    kept = torch.rand(heads, *x.shape) >= p  # head by head, in the order the layer draws them
    assert abs(kept.float().mean().item() - (1 - p)) < 5 / masks ** 0.5
    reference_weight = weight.detach().clone().requires_grad_()
    dropped = kept * x / (1 - p)  # [H, ..., N, F]
    reference = torch.einsum("h...nf,hcf->...nhc", dropped, reference_weight.view(heads, channels, features))
    (reference * probe).sum().backward()
    assert torch.equal(after, torch.rand(1))
    torch.testing.assert_close(out, reference)
    # sums over 300 nodes in another order (matrix product against einsum's)
    torch.testing.assert_close(weight.grad, reference_weight.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # MC dropout's draws: the same masks, no bits kept
        torch.manual_seed(3)
        torch.testing.assert_close(per_head_dropout_projection(x, weight, heads, p), reference)


def test_dense_data_dropout_under_autocast_gives_the_weights_a_gradient_of_their_dtype():
    """Mixed precision (``bf16-mixed``): the products run in bf16 forward and backward, and the
    float32 weights get a float32 gradient close to the float32 one of the same masks."""
    x, probe = torch.randn(200, 16), torch.randn(3)
    weights = [torch.randn(4 * 3, 16, requires_grad=True)]
    weights.append(weights[0].detach().clone().requires_grad_())
    for weight, precision in zip(weights, ("bf16", "fp32")):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = per_head_dropout_projection(x, weight, 4, 0.5)
        assert out.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        (out.float() * probe).sum().backward()
    assert weights[0].grad.dtype == torch.float32
    torch.testing.assert_close(weights[0].grad, weights[1].grad, rtol=0.05, atol=0.05)


def test_sparse_entries_gather_only_mostly_zero_data_and_are_cached_per_tensor_and_version():
    x = torch.zeros(50, 40)
    x[3, 7], x[20, 1] = 2.0, -1.0
    rows, cols, values = sparse_entries(x, out_channels=8)
    assert rows.tolist() == [3, 20] and cols.tolist() == [7, 1] and values.tolist() == [2.0, -1.0]
    assert sparse_entries(torch.ones(50, 40), out_channels=8) is None  # dense: per-head copies
    assert sparse_entries(x.clone().requires_grad_(), out_channels=8) is None

    cache = SparseEntriesCache(out_channels=8)
    first = cache(x)
    assert cache(x) is first  # the same, unchanged tensor: not recomputed
    x[0, 0] = 5.0  # an in-place write bumps the version
    changed = cache(x)
    assert changed.rows.tolist() == [0, 3, 20]
    other = x.clone()
    assert cache(other) is not changed  # another tensor, even with equal values
    x.requires_grad_()
    assert cache(x) is None
    assert pickle.loads(pickle.dumps(cache))(other).rows.tolist() == [0, 3, 20]
    with torch.inference_mode():  # MC dropout under inference mode: no version counter to cache on
        assert cache(other.detach().clone()).rows.tolist() == [0, 3, 20]


def test_per_head_dropout_drops_messages_channel_by_channel_and_only_in_training():
    """Nodes with only their self-loop and one constant feature: with one mask per head the row
    of a head's output is all zero or all kept; dropping the messages too breaks rows up."""
    x, edge_index = torch.ones(500, 1), torch.empty(2, 0, dtype=torch.long)
    outputs = {}
    for per_head in (False, True):
        torch.manual_seed(0)
        layer = BayesianGATConv(1, 16, dropout=0.5, input_dropout=0.5, dropout_per_head=per_head)
        nonzero = layer(x, edge_index).ne(0)  # the bias is zero at initialization
        outputs[per_head] = (nonzero.any(-1) & ~nonzero.all(-1)).float().mean().item()
        layer.eval()
        assert torch.equal(layer(x, edge_index), layer.lin(x))  # no dropout at evaluation
    assert outputs[False] == 0.0
    # mixed rows: input and attention weight kept (1/4), then some but not all 16 channels kept
    assert abs(outputs[True] - 0.25) < 0.06  # 500 rows: std 0.019


@pytest.mark.parametrize("self_loops", [True, False])
@pytest.mark.parametrize("variant", ["soft", "wc"])
def test_eval_mode_layer_is_pyg_gatconv_with_the_same_weights(variant, self_loops):
    """At evaluation (posterior mean) every variant is GAT's layer: same output and same attention
    per edge as PyG's GATConv holding the same parameters, with and without self-loops."""
    from torch_geometric.nn import GATConv

    x, edge_index, _ = random_graph(num_nodes=30, num_edges=90, num_features=12)
    config = BamConfig(variant, k=1.0, beta=1e-10) if variant == "wc" else BamConfig(variant)  # Cora preset
    ours = BayesianGATConv(12, 5, 3, add_self_loops=self_loops, config=config).eval()
    pyg = GATConv(12, 5, heads=3, add_self_loops=self_loops).eval()
    with torch.no_grad():
        ours.bias.normal_()  # zero at initialization: give it something to compare
        for name in ("lin.weight", "att_src", "att_dst", "bias"):
            pyg.get_parameter(name).copy_(ours.get_parameter(name))
    out, (edges, attention) = ours(x, edge_index, return_attention_weights=True)
    expected, (pyg_edges, pyg_attention) = pyg(x, edge_index, return_attention_weights=True)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.equal(edges, pyg_edges)
    assert torch.allclose(attention, pyg_attention, atol=1e-6)
    assert attention.shape == (edges.size(1), 3)


def test_padded_queries_carry_no_kl_and_do_not_count_in_the_site():
    """Self-attention over two sentences of 3 and 5 tokens, padded to 5: with the padding as a
    query mask too, the site's KL is the sum of each sentence's KL alone and its entry count that
    of the valid rows (3 x 3 + 5 x 5 per head); with keys masked only, the padded rows add KL."""
    torch.manual_seed(0)
    layer = MultiHeadBayesianAttention(8, 2, BamConfig("wc", beta=0.5, d_mid=4))
    x = torch.randn(2, 5, 8)
    valid = torch.tensor([[True] * 3 + [False] * 2, [True] * 5])

    def site_kl(inputs, keys_valid, queries_valid=None):
        def model():
            with attention_sites():
                layer(inputs, inputs, inputs, valid_keys=keys_valid, valid_queries=queries_valid)

        guide = AttentionGuide(model)
        guide()
        model_trace, guide_trace = guide.get_traces()
        return torch.distributions.kl_divergence(guide_trace.nodes["attention"]["fn"], model_trace.nodes["attention"]["fn"]).item()

    alone = sum(site_kl(x[i : i + 1, :n], valid[i : i + 1, :n]) for i, n in enumerate((3, 5)))
    assert site_kl(x, valid, valid) == pytest.approx(alone, rel=1e-5)
    assert site_kl(x, valid) > alone * (1 + 1e-3)  # the two padded rows of sentence 0 count otherwise
    axis = DenseKeys(valid[:, None, None, :], query_mask=valid[:, None, :, None])
    assert axis.num_valid(torch.zeros(2, 2, 5, 5)) == 2 * (3 * 3 + 5 * 5)
    weights = axis.softmax(torch.randn(2, 2, 5, 5))  # padded rows still normalize over valid keys
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 5))
    assert torch.all(weights[0, :, :, 3:] == 0)
    with pytest.raises(ValueError, match=r"^valid_queries of shape \(\d+, 4\) does not fit query"):
        layer(x, x, x, valid_queries=valid[:, :4])


def test_a_key_mask_shared_by_the_batch_counts_the_valid_entries_of_every_sequence():
    """The ``mean`` reduction divides a site's KL, summed over the whole batch, by its valid
    entries: a mask broadcast over the batch ([1, 1, 1, keys]) must count them for every sequence,
    as the same mask expanded does, and a batchless mask with ``batch_shape`` likewise."""
    scores = torch.randn(4, 2, 3, 5)
    shared = torch.tensor([True, True, True, False, False]).view(1, 1, 1, 5)
    expanded = DenseKeys(shared.expand(4, 1, 1, 5).clone())
    assert expanded.num_valid(scores) == 4 * 2 * 3 * 3
    for axis in (DenseKeys(shared), DenseKeys(shared[0], batch_shape=torch.Size([4]))):
        assert axis.num_valid(scores) == expanded.num_valid(scores)
        assert axis.event_dim == 4
    assert DenseKeys(batch_shape=torch.Size([4])).num_valid(scores) == scores.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_posterior_mean_prediction_is_softmax_attention_bit_for_bit(dtype):
    """In eval mode the weights are the scores' softmax itself, not a softmax of Phi = log(softmax)
    (which rounds twice: one bfloat16 ulp off eager attention)."""
    scores, keys, mask = dense_inputs()
    axis = DenseKeys(mask)
    layer = BayesianAttention(BamConfig("wc", k=5.0, d_mid=5), num_heads=3, key_dim=5).to(dtype).eval()
    assert torch.equal(layer(scores.to(dtype), keys.to(dtype), axis), axis.softmax(scores.to(dtype)))


def test_a_decoder_computes_the_contextual_prior_of_its_keys_once_per_pass():
    """Steps that attend to views of one keys tensor share its prior logits (one prior network
    call per pass), with the same prior densities and gradients as computing them at every step;
    keys changed in place are computed again."""
    from bam_pyro.axes import DenseKeys

    torch.manual_seed(0)
    attention = BayesianAttention(BamConfig("wc", k=10.0, beta=1e-2, d_mid=4), num_heads=1, key_dim=6)
    states = torch.randn(3, 5, 6, requires_grad=True)
    scores = torch.randn(4, 3, 1, 1, 5)  # four steps of three queries
    calls = []
    attention.prior_net.register_forward_hook(lambda *_: calls.append(1))

    def kl_of_steps(fresh_keys: bool) -> torch.Tensor:
        total = torch.zeros(())
        with attention_sites() as sites:
            for step in range(4):
                keys = states.clone().unsqueeze(-2) if fresh_keys else states.unsqueeze(-2)
                phi = log_normalized(DenseKeys(None, batch_shape=(3,)), scores[step])
                prior = attention.prior(phi, keys, DenseKeys(None, batch_shape=(3,)))
                total = total + prior.log_prob(phi.exp()).sum()
        return total

    shared = kl_of_steps(fresh_keys=False)
    assert len(calls) == 1
    (grad_shared,) = torch.autograd.grad(shared, states)
    calls.clear()
    separate = kl_of_steps(fresh_keys=True)
    assert len(calls) == 4
    (grad_separate,) = torch.autograd.grad(separate, states)
    torch.testing.assert_close(shared, separate)
    torch.testing.assert_close(grad_shared, grad_separate)

    calls.clear()
    keys = torch.randn(3, 5, 1, 6)
    with attention_sites():
        first = attention._prior_logits(keys, torch.float32)
        keys.mul_(2.0)  # changed in place: computed again
        second = attention._prior_logits(keys, torch.float32)
    assert len(calls) == 2 and not torch.allclose(first, second)


def test_compiled_attention_of_several_modules_over_several_keys_compiles_once():
    """Under torch.compile the keys' identities are not looked up (a guard on them recompiled every
    layer of a transformer until Dynamo's limit): the prior logits of a second module and other
    keys reuse the first compiled graph."""
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    config = BamConfig("wc", k=10.0, beta=1e-2, d_mid=4)
    layers = [BayesianAttention(config, num_heads=1, key_dim=6) for _ in range(2)]

    def logits(layer: BayesianAttention, keys: torch.Tensor) -> torch.Tensor:
        return layer._prior_logits(keys, torch.float32)

    dynamo.reset()
    compiled = torch.compile(logits, backend="eager")
    try:
        with attention_sites(), dynamo.config.patch(error_on_recompile=True):
            for layer in layers:
                keys = torch.randn(3, 5, 1, 6)
                torch.testing.assert_close(compiled(layer, keys), logits(layer, keys))
    finally:
        dynamo.reset()
