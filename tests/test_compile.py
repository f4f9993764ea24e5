"""torch.compile of the dense and the edge Bayesian attention: one graph, no graph break, in the
point prediction (eval) and in training mode outside a Pyro model (S drawn from q), with the
outputs of eager mode; and of the KL an attention site gives the ELBO.

Graph breaks are counted by ``torch._dynamo.explain``; ``fullgraph=True`` compiles with Inductor and
would raise at a break. The graph attention gets its self-loops beforehand (``add_self_loops=False``):
PyG's ``remove_self_loops``, which GATConv runs too, selects edges by a boolean mask, a shape that
depends on the data. Inside a Pyro model each attention call is a ``pyro.sample`` statement, where
Dynamo stops (Pyro's message is a ``TypedDict`` with optional keys, which it does not trace).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch._inductor import config as inductor_config
from torch.distributions import kl_divergence

from bam_pyro import BamConfig, MultiHeadBayesianAttention
from bam_pyro.attention_map import AttentionMap
from bam_pyro.distributions import prior_distribution, variational_distribution
from bam_pyro.pyg import BayesianGATConv, BayesianGATv2Conv, BayesianTransformerConv
from models.gat import with_self_loops

CONFIGS = {"wc": BamConfig("wc", k=10.0, beta=1e-2, d_mid=3), "lc": BamConfig("lc", sigma_q=0.5, sigma_p=2.0, d_mid=3),
           "wf": BamConfig("wf", k=5.0, beta=1e-2, alpha=1e-3), "nokl": BamConfig("nokl", k=5.0)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def dense_call(config: BamConfig):
    attention = MultiHeadBayesianAttention(16, 2, config)
    x = torch.randn(3, 5, 16)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[1, 3:] = False
    valid[2] = False  # an empty sequence

    def call(x, valid):
        return attention(x, x, x, valid_keys=valid, valid_queries=valid)[0]

    return attention, call, (x, valid)


def edge_call(conv_type, config: BamConfig):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 6, generator=g)
    edge_index = torch.randint(0, 12, (2, 40), generator=g)
    if conv_type is BayesianTransformerConv:  # adds no self-loops
        conv = conv_type(6, 4, heads=2, config=config)
    else:
        conv = conv_type(6, 4, heads=2, config=config, add_self_loops=False)
        edge_index = with_self_loops(edge_index, 12)
    return conv, conv, (x, edge_index)


CALLS = {"dense": lambda config: dense_call(config),
         **{name: (lambda config, t=conv: edge_call(t, config))
            for name, conv in (("gat", BayesianGATConv), ("gatv2", BayesianGATv2Conv), ("transformer", BayesianTransformerConv))}}


#: the fast set: both families with their contextual priors, on the dense and the GAT attention
FAST = {("dense", "wc"), ("dense", "lc"), ("gat", "wc"), ("gat", "lc")}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind, variant", [
    pytest.param(kind, variant, marks=() if (kind, variant) in FAST else pytest.mark.slow)
    for kind in sorted(CALLS) for variant in sorted(CONFIGS)])
def test_attention_traces_into_one_graph(kind, variant, training):
    module, call, args = CALLS[kind](CONFIGS[variant])
    module.train(training)
    explained = dynamo.explain(call)(*args)
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.slow  # Inductor compiles forward and backward: about 30 s each on a loaded 2-core machine
@pytest.mark.parametrize("kind", ["dense", "gat"])
def test_fullgraph_compiled_attention_gives_eager_outputs_and_gradients(kind):
    """Eval: the posterior mean. Training: the same draws (Inductor's random numbers as eager's),
    hence the same weights, outputs and gradients."""
    module, call, args = CALLS[kind](CONFIGS["wc"])
    compiled = torch.compile(call, fullgraph=True)
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), call(*args))
    module.train()
    parameters = [p for name, p in module.named_parameters() if "prior_net" not in name]  # no prior outside Pyro
    with inductor_config.patch(fallback_random=True):
        torch.manual_seed(1)
        expected = call(*args)
        expected_grads = torch.autograd.grad(expected.square().sum(), parameters)
        torch.manual_seed(1)
        got = compiled(*args)
        got_grads = torch.autograd.grad(got.square().sum(), parameters)
    torch.testing.assert_close(got, expected)
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad)


@pytest.mark.parametrize("variant", ["wc", "wf", "lc", "lf"])
def test_the_sites_kl_traces_into_one_graph(variant):
    """The KL the ELBO reads at an attention site, padded keys masked: one graph too."""
    config = BamConfig(variant, k=5.0, beta=1e-2, alpha=1e-3, sigma_q=0.5, sigma_p=2.0)
    phi = torch.randn(2, 3, 4, 5).log_softmax(-1)
    log_psi = torch.randn(2, 3, 1, 5).log_softmax(-1) if config.prior == "contextual" else None
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., 3:] = False

    def site_kl(phi, mask):
        q = AttentionMap(variational_distribution(phi, config), mask, 4)
        p = AttentionMap(prior_distribution(log_psi, config, phi.shape, phi), mask, 4)
        return kl_divergence(q, p)

    explained = dynamo.explain(site_kl)(phi, mask)
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    torch.testing.assert_close(torch.compile(site_kl, fullgraph=True, backend="eager")(phi, mask), site_kl(phi, mask))


@pytest.mark.slow  # compiles two GATs: about a minute
def test_gat_bench_compile_prints_eager_and_compiled_times_and_paired_ratios(capsys):
    import json

    from experiments.gat import benchmark as gat

    gat.main(["--nodes", "60", "--edges", "240", "--features", "8", "--steps", "3", "--threads", "1", "--compile",
              "--models", "soft", "wc"])
    figures = json.loads(capsys.readouterr().out)
    for key in ("soft_ms", "soft_compiled_ms", "bam_ms", "bam_compiled_ms"):
        assert figures[key] > 0, key
    for key in ("bam_compiled_over_eager", "soft_compiled_over_eager", "bam_over_soft_compiled"):
        low, high = figures[key]["iqr"]
        assert low <= figures[key]["median"] <= high, key


@pytest.mark.slow  # compiles a GAT's network and its whole step: about two minutes
def test_gat_bench_compile_step_adds_the_whole_step_compiled_with_its_ratios(capsys):
    import json

    from experiments.gat import benchmark as gat

    gat.main(["--nodes", "60", "--edges", "240", "--features", "8", "--steps", "3", "--threads", "1",
              "--compile", "step", "--models", "wc"])
    figures = json.loads(capsys.readouterr().out)
    for key in ("bam_ms", "bam_compiled_ms", "bam_step_compiled_ms"):
        assert figures[key] > 0, key
    for key in ("bam_compiled_over_eager", "bam_step_compiled_over_eager", "bam_step_over_network_compiled"):
        low, high = figures[key]["iqr"]
        assert low <= figures[key]["median"] <= high, key


def test_compiled_sparse_dropout_projection_holds_no_bool_mask():
    """The per-head dropout masks at the nonzeros of sparse input features are drawn eagerly
    (gat_conv._kept_values), so that neither the forward nor the backward graph of the compiled
    projection holds a bool tensor: Inductor's CPU code writes those an order of magnitude slower
    than ATen (issue 33; the benchmarks page, "Compiled GAT"). Same draws, outputs and gradient
    as eager mode."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from bam_pyro.pyg.gat_conv import per_head_dropout_projection, sparse_entries

    g = torch.Generator().manual_seed(0)
    x = (torch.rand(30, 40, generator=g) < 0.1).float()  # bag-of-words-like features
    weight = torch.randn(2 * 4, 40, generator=g, requires_grad=True)
    entries = sparse_entries(x, 4)
    assert entries is not None
    graphs = []

    def capture(graph_module, _example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    def project(x, weight, rows, cols, values):
        return per_head_dropout_projection(x, weight, 2, 0.5, type(entries)(rows, cols, values))

    compiled = torch.compile(project, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    torch.manual_seed(1)
    expected = project(x, weight, *entries)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), weight)
    torch.manual_seed(1)
    got = compiled(x, weight, *entries)
    (got_grad,) = torch.autograd.grad(got.square().sum(), weight)
    assert len(graphs) >= 2  # a forward and a backward graph
    bools = [node for graph in graphs for node in graph.graph.nodes
             if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dtype == torch.bool]
    assert not bools, [node.format_node() for node in bools]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grad, expected_grad)


class StackedGAT(torch.nn.Module):
    """``depth`` Bayesian GAT layers of one shape (8 channels in and out): every layer after the first
    is the same compiled code, under another site and parameter names."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.convs = torch.nn.ModuleList(
            BayesianGATConv(8, 4, heads=2, config=CONFIGS["wc"], add_self_loops=False) for _ in range(depth))

    def forward(self, x, edge_index):
        for conv in self.convs:
            x = torch.tanh(conv(x, edge_index))
        return x


def svi_steps(depth: int, steps: int, compiled: bool):
    """``steps`` losses and gradients of an annealed node classifier on a 20-node graph, seeded, its
    whole loss (``differentiable_loss``: network, guide and ELBO) compiled or not; with the count of
    graphs Dynamo made after the first two steps and after all."""
    from torch._dynamo.testing import CompileCounter

    from bam_pyro import AttentionGuide, ObjectiveConfig
    from bam_pyro.elbo import AttentionMeanFieldELBO
    from bam_pyro.pyg import NodeClassifier

    g = torch.Generator().manual_seed(0)
    x, edge_index = torch.randn(20, 8, generator=g), with_self_loops(torch.randint(0, 20, (2, 60), generator=g), 20)
    y, nodes = torch.randint(0, 8, (20,), generator=g), torch.arange(0, 20, 2)
    torch.manual_seed(0)
    model = NodeClassifier(StackedGAT(depth), ObjectiveConfig(anneal_rate=0.5))
    guide, counter = AttentionGuide(model.model), CompileCounter()
    loss_of = AttentionMeanFieldELBO().differentiable_loss
    if compiled:
        loss_of = torch.compile(loss_of, backend=counter)
    results, counts = [], []
    for step in range(steps):
        torch.manual_seed(10 + step)
        loss = loss_of(model.model, guide, x, edge_index, y=y, nodes=nodes, step=step)
        results.append((loss.detach(), torch.autograd.grad(loss, list(model.parameters()))))
        counts.append(counter.frame_count)
    return results, counts


def test_a_compiled_svi_step_gives_eager_losses_and_gradients_and_compiles_once():
    """The whole SVI step compiled (issue 44): after the first two steps (validated, then not) no
    graph is compiled again, although the KL weight, the target's distribution and the loss are new
    values at each step; and the same losses and gradients as eager mode under the same seeds."""
    with dynamo.config.patch(recompile_limit=64):  # a recompilation per step or name shows, not capped at 8
        got, counts = svi_steps(depth=2, steps=5, compiled=True)
    expected, _ = svi_steps(depth=2, steps=5, compiled=False)
    assert counts[1] == counts[-1], counts
    for (got_loss, got_grads), (loss, grads) in zip(got, expected):
        torch.testing.assert_close(got_loss, loss)
        for got_grad, grad in zip(got_grads, grads):
            torch.testing.assert_close(got_grad, grad)


def test_a_compiled_svi_step_does_not_compile_per_layer_or_name():
    """Four layers of one shape compile no more graphs than two: their attention sites and Pyro
    params, each under its own name, do not specialize the compiled code (issue 44: ``pyro.param``
    recompiled once per parameter name until Dynamo's recompile limit)."""
    with dynamo.config.patch(recompile_limit=64):
        # three steps: the frame of the target's pyro.sample guards on whether distributions validate,
        # and may compile both ways (validated first step, then not) in either run
        _, two = svi_steps(depth=2, steps=3, compiled=True)
        dynamo.reset()
        _, four = svi_steps(depth=4, steps=3, compiled=True)
    assert four[-1] == two[-1], (two, four)
