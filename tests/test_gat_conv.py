"""BayesianGATConv as a drop-in for PyG's GATConv: signature, every input form PyG's GATConv takes
(bipartite, size, edge features with fill values, residual, no bias, torch.sparse and SparseTensor
adjacency, empty graphs), parameter-for-parameter equality with GATConv under soft attention (and
under the posterior mean of a stochastic variant), and to_hetero; BayesianGATv2Conv and
BayesianTransformerConv, on the same core, against GATv2Conv and TransformerConv.

The first part restates the cases of PyG's own ``test/nn/conv/test_gat_conv.py`` as behaviour
checks run on both classes: through the one-line adapter ``CONVS``, what holds for GATConv must
hold for BayesianGATConv.
"""

import inspect

import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO
from torch import nn
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv, to_hetero
from torch_geometric.typing import WITH_TORCH_SPARSE, SparseTensor
from torch_geometric.utils import to_edge_index, to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.pyg import BayesianGATv2Conv, BayesianTransformerConv
from bam_pyro.pyg import BayesianGATConv, NodeClassifier
from models.gat import GAT

CONVS = [pytest.param(GATConv, id="GATConv"), pytest.param(BayesianGATConv, id="BayesianGATConv")]
WC = BamConfig("wc", k=1.0, beta=1e-10)  # the Cora preset
needs_torch_sparse = pytest.mark.skipif(not WITH_TORCH_SPARSE, reason="torch_sparse is not installed")


@pytest.fixture(autouse=True)
def _one_thread(_seed_and_threads):
    torch.set_num_threads(1)  # tiny graphs: threads only contend


@pytest.fixture
def small_graph():
    """PyG's test graph: 4 source nodes (8 features), 2 target nodes (16 features)."""
    x1, x2 = torch.randn(4, 8), torch.randn(2, 16)
    edge_index = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]])
    return x1, x2, edge_index


# --- PyG's GATConv tests, as behaviour both classes share -------------------------------------


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("conv_class", CONVS)
def test_pyg_cases_homogeneous_graph(conv_class, residual, small_graph):
    x1, _, edge_index = small_graph
    conv = conv_class(8, 32, heads=2, residual=residual)
    assert str(conv) == f"{conv_class.__name__}(8, 32, heads=2)"
    out = conv(x1, edge_index)
    assert out.shape == (4, 64)
    assert torch.allclose(conv(x1, edge_index, size=(4, 4)), out)
    adj_t = to_torch_csc_tensor(edge_index, size=(4, 4)).t()
    assert torch.allclose(conv(x1, adj_t), out, atol=1e-6)

    result, (edges, weights) = conv(x1, edge_index, return_attention_weights=True)
    assert torch.allclose(result, out)
    assert edges.shape == (2, 7) and weights.shape == (7, 2)  # 4 edges, one removed self-loop, 4 added
    assert weights.min() >= 0 and weights.max() <= 1

    result, (adj, weights) = conv(x1, adj_t, return_attention_weights=True)
    assert torch.allclose(result, out, atol=1e-6)
    assert adj.shape == (4, 4, 2) and adj._nnz() == 7


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("conv_class", CONVS)
def test_pyg_cases_bipartite_graph(conv_class, residual, small_graph):
    x1, x2, edge_index = small_graph
    conv = conv_class((8, 16), 32, heads=2, residual=residual)
    assert str(conv) == f"{conv_class.__name__}((8, 16), 32, heads=2)"
    adj_t = to_torch_csc_tensor(edge_index, size=(4, 2)).t()

    out = conv((x1, x2), edge_index)
    assert out.shape == (2, 64)
    assert torch.allclose(conv((x1, x2), edge_index, size=(4, 2)), out)
    assert torch.allclose(conv((x1, x2), adj_t), out, atol=1e-6)

    sources_only = conv((x1, None), edge_index, size=(4, 2))
    assert sources_only.shape == (2, 64)
    assert torch.allclose(conv((x1, None), adj_t), sources_only, atol=1e-6)


@needs_torch_sparse
@pytest.mark.parametrize("conv_class", CONVS)
def test_pyg_cases_sparse_tensor_adjacency(conv_class, small_graph):
    x1, x2, edge_index = small_graph
    conv = conv_class(8, 32, heads=2)
    out = conv(x1, edge_index)
    adj = SparseTensor.from_edge_index(edge_index, sparse_sizes=(4, 4))
    assert torch.allclose(conv(x1, adj.t()), out, atol=1e-6)
    result, weights = conv(x1, adj.t(), return_attention_weights=True)
    assert torch.allclose(result, out, atol=1e-6)
    assert weights.sizes() == [4, 4, 2] and weights.nnz() == 7

    conv = conv_class((8, 16), 32, heads=2)
    adj = SparseTensor.from_edge_index(edge_index, sparse_sizes=(4, 2))
    assert torch.allclose(conv((x1, x2), adj.t()), conv((x1, x2), edge_index), atol=1e-6)
    assert torch.allclose(conv((x1, None), adj.t()), conv((x1, None), edge_index, size=(4, 2)), atol=1e-6)


@pytest.mark.parametrize("conv_class", CONVS)
def test_pyg_cases_edge_features(conv_class):
    x = torch.randn(4, 8)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 0, 1, 1]])
    edge_weight, edge_attr = torch.randn(4), torch.randn(4, 4)
    for edge_dim, features in ((1, edge_weight), (4, edge_attr)):
        for fill_value in (0.5, "mean"):
            conv = conv_class(8, 32, heads=2, edge_dim=edge_dim, fill_value=fill_value)
            assert conv(x, edge_index, features).shape == (4, 64)
            if WITH_TORCH_SPARSE:  # self-loops with edge features: not for a SparseTensor
                adj = SparseTensor.from_edge_index(edge_index, features, (4, 4))
                with pytest.raises(NotImplementedError):
                    conv(x, adj.t())


@pytest.mark.parametrize("conv_class", CONVS)
def test_pyg_cases_empty_graph(conv_class):
    conv = conv_class(8, 32, heads=2)
    assert conv(torch.randn(0, 8), torch.empty(2, 0, dtype=torch.long)).shape == (0, 64)


# --- the same call, the same arguments ----------------------------------------------------------


def test_signature_is_gatconvs_then_keyword_only_extras():
    def positional(function):
        return [
            (p.name, p.default) for p in inspect.signature(function).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"
        ]

    assert positional(BayesianGATConv.__init__) == positional(GATConv.__init__)
    assert positional(BayesianGATConv.forward) == positional(GATConv.forward)
    extras = {
        p.name for p in inspect.signature(BayesianGATConv.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY
    }
    assert extras == {"config", "input_dropout", "dropout_per_head"}
    assert BayesianGATConv(8, 4).attention.config.variant == "soft"  # the default is GATConv


def test_third_positional_argument_is_the_edge_features():
    """``conv(x, edge_index, edge_weight)`` as with GATConv: the weights are edge features (used
    with ``edge_dim=1``), never a request for the attention weights."""
    x, edge_index = torch.randn(5, 8), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    edge_weight = torch.tensor([0.5])  # one edge weight... of a one-edge graph
    single_edge = edge_index[:, :1]
    conv = BayesianGATConv(8, 4, edge_dim=1, fill_value=0.0).eval()
    out = conv(x, single_edge, edge_weight)
    assert isinstance(out, torch.Tensor) and out.shape == (5, 4)
    assert not torch.allclose(out, conv(x, single_edge, edge_weight + 3.0))  # the weight is read

    plain = BayesianGATConv(8, 4)
    with pytest.warns(UserWarning, match="edge_attr is ignored"):
        ignored = plain(x, single_edge, edge_weight)  # GATConv without edge_dim ignores it too
    assert torch.equal(ignored, plain(x, single_edge))


# --- parameter for parameter: GATConv's outputs and attention weights ---------------------------


def copy_into(pyg: GATConv, ours: BayesianGATConv) -> None:
    """GATConv's parameters into ours, every one of them: ours has no other but the prior's."""
    missing, unexpected = ours.load_state_dict(pyg.state_dict(), strict=False)
    assert not unexpected
    assert all(name.startswith("attention.prior_net.") for name in missing)


def graph_inputs(form: str, edge_dim=None):
    """(args, kwargs) of one forward call of each input form, on a graph with self-loops and
    repeated edges; ``ctor`` is the layer's in_channels."""
    g = torch.Generator().manual_seed(1)
    x_src, x_dst = torch.randn(7, 6, generator=g), torch.randn(5, 3, generator=g)
    edge_index = torch.stack([torch.randint(0, 7, (20,), generator=g), torch.randint(0, 5, (20,), generator=g)])
    edge_index[:, :3] = torch.tensor([[0, 1, 1], [0, 1, 1]])  # self-loops, one repeated
    kwargs = {}
    if edge_dim is not None:
        kwargs["edge_attr"] = torch.randn(20, edge_dim, generator=g) if edge_dim > 1 else torch.randn(20, generator=g)
    if form == "bipartite":
        return (6, 3), ((x_src, x_dst), edge_index), kwargs
    if form == "sources only":
        return (6, 3), ((x_src, None), edge_index), {**kwargs, "size": (7, 5)}
    if form == "pair, shared weights":
        return 6, ((x_src, x_src[:5]), edge_index), kwargs
    if form == "lazy bipartite":
        return (-1, -1), ((x_src, x_dst), edge_index), kwargs
    x, square = x_src, edge_index.clamp(max=6)
    if form.startswith("torch.sparse"):  # edge features, if any, as the adjacency's values
        to_sparse = {"coo": to_torch_coo_tensor, "csr": to_torch_csr_tensor}[form.split()[-1]]
        features = kwargs.get("edge_attr") if edge_dim and edge_dim > 1 else None
        return 6, (x, to_sparse(square.flip(0), features, size=(7, 7))), {}
    if form == "size":
        return 6, (x, square), {**kwargs, "size": (7, 7)}
    return (-1 if form == "lazy" else 6), (x, square), kwargs


FORMS = ["plain", "size", "lazy", "bipartite", "sources only", "pair, shared weights", "lazy bipartite",
         "torch.sparse coo", "torch.sparse csr"]  # GATConv itself refuses a CSC adj_t
OPTIONS = {
    "defaults": {},
    "heads, mean": dict(heads=3, concat=False),
    "no bias, slope": dict(heads=2, bias=False, negative_slope=0.1),
    "residual": dict(heads=2, residual=True),
    "no self-loops": dict(heads=2, add_self_loops=False),
}


def assert_same_as_pyg(args, kwargs, in_channels, options, config, train=False, pyg_class=GATConv, our_class=BayesianGATConv):
    pyg = pyg_class(in_channels, 4, **options)
    ours = our_class(in_channels, 4, **options, config=config)
    pyg.train(train), ours.train(train)
    if -1 in (in_channels if isinstance(in_channels, tuple) else (in_channels,)):
        pyg(*args, **kwargs), ours(*args, **kwargs)  # materialize the lazy weights
    with torch.no_grad():
        if isinstance(getattr(pyg, "bias", None), nn.Parameter):
            pyg.bias.normal_()  # zero at initialization: give it something to compare
    copy_into(pyg, ours)
    torch.manual_seed(3)
    out, (adj, weights) = ours(*args, **kwargs, return_attention_weights=True)
    torch.manual_seed(3)
    expected, (pyg_adj, pyg_weights) = pyg(*args, **kwargs, return_attention_weights=True)
    assert torch.allclose(out, expected, atol=1e-5)
    if adj.layout != torch.strided:  # a sparse adjacency, its entries in the order of the weights
        assert adj.layout == pyg_adj.layout and adj.shape[:2] == pyg_adj.shape[:2]
        assert torch.equal(to_edge_index(adj)[0], to_edge_index(pyg_adj)[0])
    else:
        assert torch.equal(adj, pyg_adj)
    assert torch.allclose(weights, pyg_weights, atol=1e-6)


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("form", FORMS)
def test_soft_attention_is_gatconv(form, options):
    in_channels, args, kwargs = graph_inputs(form)
    if form == "sources only" and options.get("residual"):
        pytest.skip("no targets, nothing to add a residual to")
    assert_same_as_pyg(args, kwargs, in_channels, options, BamConfig("soft"))


@pytest.mark.parametrize("fill_value", [0.5, "mean", "add", torch.tensor([1.0, -2.0, 0.5])])
@pytest.mark.parametrize("form", ["plain", "bipartite"])
def test_soft_attention_with_edge_features_is_gatconv(form, fill_value):
    in_channels, args, kwargs = graph_inputs(form, edge_dim=3)
    assert_same_as_pyg(args, kwargs, in_channels, dict(heads=2, edge_dim=3, fill_value=fill_value), BamConfig("soft"))
    in_channels, args, kwargs = graph_inputs(form, edge_dim=1)  # one weight per edge
    assert_same_as_pyg(args, kwargs, in_channels, dict(heads=2, edge_dim=1), BamConfig("soft"))


def test_attention_dropout_is_gatconvs_in_training():
    """``dropout`` is GATConv's: on the attention weights only (the same draws give the same
    output), and the weights returned are those that weighted the messages."""
    in_channels, args, kwargs = graph_inputs("plain")
    assert_same_as_pyg(args, kwargs, in_channels, dict(heads=2, dropout=0.4), BamConfig("soft"), train=True)


@pytest.mark.parametrize("variant", ["lf", "wc"])
@pytest.mark.parametrize("form", ["plain", "bipartite", "torch.sparse csr"])
def test_posterior_mean_of_stochastic_attention_is_gatconv(form, variant):
    in_channels, args, kwargs = graph_inputs(form)
    assert_same_as_pyg(args, kwargs, in_channels, dict(heads=2), BamConfig(variant))


def test_sample_dimensions_broadcast_through():
    """Vectorized posterior samples: leading dims of the node features pass through each layer."""
    in_channels, (x, edge_index), _ = graph_inputs("plain")
    conv = BayesianGATConv(in_channels, 4, heads=2, residual=True).eval()
    stacked = torch.stack([x, 2 * x])
    out = conv(stacked, edge_index)
    assert torch.allclose(out[1], conv(2 * x, edge_index), atol=1e-6)
    _, adj_t = graph_inputs("torch.sparse csr")[1]
    with pytest.raises(ValueError, match="sample dimensions"):
        conv(stacked, adj_t, return_attention_weights=True)


# --- GATv2Conv and TransformerConv: the same core, another scoring function ---------------------

ON_THE_CORE = {
    "GATv2Conv": (GATv2Conv, BayesianGATv2Conv, {
        "defaults": {},
        "heads, mean": dict(heads=3, concat=False),
        "shared weights, no bias": dict(heads=2, share_weights=True, bias=False),
        "residual, edge features": dict(heads=2, residual=True, edge_dim=3, fill_value=0.5),
        "no self-loops": dict(heads=2, add_self_loops=False),
    }),
    "TransformerConv": (TransformerConv, BayesianTransformerConv, {
        "defaults": {},
        "heads, mean": dict(heads=3, concat=False),
        "beta gate, edge features": dict(heads=2, beta=True, edge_dim=3),
        "no root weight, no bias": dict(heads=2, root_weight=False, bias=False),
    }),
}
CORE_CASES = [
    pytest.param(classes, options, id=f"{name}-{option_name}")
    for name, (*classes, option_sets) in ON_THE_CORE.items()
    for option_name, options in option_sets.items()
]


@pytest.mark.parametrize("form", ["plain", "lazy", "bipartite", "pair, shared weights", "torch.sparse csr"])
@pytest.mark.parametrize("classes, options", CORE_CASES)
def test_soft_attention_is_gatv2conv_and_transformerconv(classes, options, form):
    if options.get("share_weights") and form == "bipartite":
        pytest.skip("sources and targets of different widths cannot share a projection")
    in_channels, args, kwargs = graph_inputs(form, edge_dim=options.get("edge_dim"))
    pyg_class, our_class = classes
    assert_same_as_pyg(args, kwargs, in_channels, options, BamConfig("soft"), pyg_class=pyg_class, our_class=our_class)
    assert_same_as_pyg(args, kwargs, in_channels, options, WC, pyg_class=pyg_class, our_class=our_class)  # posterior mean


@pytest.mark.parametrize("flag", [None, False, True])
@pytest.mark.parametrize("classes", [(GATv2Conv, BayesianGATv2Conv), (TransformerConv, BayesianTransformerConv)],
                         ids=["GATv2Conv", "TransformerConv"])
def test_return_attention_weights_returns_what_pyg_returns_for_each_flag(classes, flag):
    """TransformerConv returns the weights for any bool, False too; GATv2Conv only for True."""
    pyg_class, our_class = classes
    _, (x, edge_index), _ = graph_inputs("plain")
    theirs = pyg_class(6, 4, heads=2)(x, edge_index, return_attention_weights=flag)
    ours = our_class(6, 4, heads=2)(x, edge_index, return_attention_weights=flag)
    assert isinstance(ours, tuple) == isinstance(theirs, tuple)


@pytest.mark.parametrize("our_class", [BayesianGATv2Conv, BayesianTransformerConv])
def test_gatv2_and_transformer_are_attention_sites(our_class):
    """Stochastic attention on the shared core: one site per layer, its KL read by the ELBO."""
    network = our_class(6, 4, heads=2, config=WC)
    model = NodeClassifier(network, ObjectiveConfig())
    _, (x, edge_index), _ = graph_inputs("plain")
    guide = AttentionGuide(model.model)
    loss = TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, edge_index, y=torch.randint(0, 4, (7,)))
    loss.backward()
    model_trace, guide_trace = guide.get_traces()
    assert [name for name, site in guide_trace.nodes.items() if site["type"] == "sample"] == ["attention"]
    kl = torch.distributions.kl_divergence(guide_trace.nodes["attention"]["fn"], model_trace.nodes["attention"]["fn"])
    assert kl.item() > 0
    assert all(p.grad is not None for p in network.parameters())


# --- empty graphs -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["soft", "wc"])
def test_graph_without_edges_gives_the_bias(variant):
    """No edges and no self-loops: every node aggregates nothing, as in GATConv."""
    conv = BayesianGATConv(8, 4, heads=2, add_self_loops=False, config=BamConfig(variant))
    with torch.no_grad():
        conv.bias.normal_()
    x, no_edges = torch.randn(5, 8), torch.empty(2, 0, dtype=torch.long)
    for mode in (True, False):
        out, (edges, weights) = conv.train(mode)(x, no_edges, return_attention_weights=True)
        assert torch.equal(out, conv.bias.expand(5, 8))
        assert edges.shape == (2, 0) and weights.shape == (0, 2)


@pytest.mark.parametrize("variant", ["wf", "wc", "lc"])
def test_empty_attention_site_has_zero_kl(variant):
    """In a Pyro model, a layer over no edges is a site with an empty event: its KL is 0 and the
    loss is the likelihood's alone (the other layer's site has no edges either)."""
    network = GAT(8, 3, BamConfig(variant), hidden=4, heads=2, dropout=0.0)
    for conv in (network.conv1, network.conv2):
        conv.add_self_loops = False
    model = NodeClassifier(network, ObjectiveConfig(reduction="sum"))
    x, no_edges, y = torch.randn(6, 8), torch.empty(2, 0, dtype=torch.long), torch.randint(0, 3, (6,))
    guide = AttentionGuide(model.model)
    guide(x, no_edges, y=y)
    model_trace, guide_trace = guide.get_traces()
    for name in ("conv1.attention", "conv2.attention"):
        kl = torch.distributions.kl_divergence(guide_trace.nodes[name]["fn"], model_trace.nodes[name]["fn"])
        assert kl.shape == () and kl.item() == 0.0
    loss = TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, no_edges, y=y)
    logits = network.conv2.bias.expand(6, 3)  # no edges: the output layer gives its bias
    expected = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
    assert torch.allclose(loss, expected, atol=1e-5)


# --- heterogeneous graphs -----------------------------------------------------------------------


class OneLayer(nn.Module):
    def __init__(self, conv_class, **kwargs):
        super().__init__()
        self.conv = conv_class((-1, -1), 8, heads=2, add_self_loops=False, **kwargs)

    def forward(self, x, edge_index):
        return self.conv(x, edge_index)


def hetero_graph():
    x = {"paper": torch.randn(5, 6), "author": torch.randn(4, 3)}
    edges = {
        ("author", "writes", "paper"): torch.tensor([[0, 1, 2, 3, 3], [0, 0, 1, 2, 4]]),
        ("paper", "cites", "paper"): torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]]),
        ("paper", "rev_writes", "author"): torch.tensor([[0, 0, 1, 2, 4], [0, 1, 2, 3, 3]]),
    }
    return x, edges, (list(x), list(edges))


def test_to_hetero_gives_gatconvs_outputs():
    x, edges, metadata = hetero_graph()
    ours = to_hetero(OneLayer(BayesianGATConv), metadata, aggr="sum")
    pyg = to_hetero(OneLayer(GATConv), metadata, aggr="sum")
    out = ours(x, edges)
    pyg(x, edges)  # lazy weights
    pyg.load_state_dict(ours.state_dict())
    expected = pyg(x, edges)
    assert out.keys() == expected.keys()
    for node_type in out:
        assert torch.allclose(out[node_type], expected[node_type], atol=1e-6)


def test_to_hetero_model_has_one_attention_site_per_edge_type():
    x, edges, metadata = hetero_graph()
    network = to_hetero(OneLayer(BayesianGATConv, config=WC, input_dropout=0.5, dropout_per_head=True), metadata)
    network(x, edges)  # lazy weights

    class PaperClassifier(NodeClassifier):
        def likelihood(self, outputs, y=None):
            super().likelihood(outputs["paper"], y)

    model = PaperClassifier(network, ObjectiveConfig())
    guide = AttentionGuide(model.model)
    loss = TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, edges, y=torch.randint(0, 8, (5,)))
    loss.backward()
    sites = [name for name, site in guide.get_traces()[1].nodes.items() if site["type"] == "sample"]
    assert sorted(sites) == sorted(f"conv.{'__'.join(edge_type)}.attention" for edge_type in edges)
    # the authors' outputs are not observed: their layer learns from its KL alone, its bias not at all
    unused = [name for name, param in network.named_parameters() if param.grad is None]
    assert unused == ["conv.paper__rev_writes__author.bias"]


def test_pyro_render_model_reads_the_gat(tmp_path):
    """Provenance tracking (pyro.render_model, get_model_relations) runs through the layers: each
    attention site depends on the one below, the labels on both."""
    network = GAT(8, 3, WC, hidden=4, heads=2)
    model = NodeClassifier(network, ObjectiveConfig())
    x, edge_index, y = torch.randn(6, 8), torch.tensor([[0, 1, 2], [1, 2, 3]]), torch.randint(0, 3, (6,))
    relations = pyro.infer.inspect.get_model_relations(model.model, (x, edge_index), {"y": y})
    assert relations["sample_sample"] == {
        "conv1.attention": [], "conv2.attention": ["conv1.attention"], "y": ["conv1.attention", "conv2.attention"],
    }
    pytest.importorskip("graphviz")
    pyro.render_model(model.model, (x, edge_index), {"y": y}, filename=str(tmp_path / "gat.svg"))
