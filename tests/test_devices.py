"""Every tensor the library makes follows its inputs' device and dtype, and the attention hot path
reads no tensor value on the host.

On the ``meta`` device tensors have shapes but no values: a tensor made on another device fails
to combine with them, and a host read (``.item()``, ``bool(t)``, ``int(t)``) raises "cannot be
called on meta tensors". Each attention kind and each task's network and guide runs there, model
and guide together, with the ELBO's terms computed from the guide's traces: Pyro's own ELBOs read
the loss value on the host (``torch_item`` in ``TraceMeanField_ELBO``), which meta cannot do.

The models hold no step counter (the loop passes its training step, a Python int), so a model moves
to meta whole. Known host reads that stay, outside these tests' reach: the translation encoders pack
sequences, and ``pack_padded_sequence`` takes its lengths on the CPU; a transformers mask that
``bam_pyro.transformers.bam_mask`` did not build (sliding windows, caches, custom masks) is read to
tell its layout.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.distributions import kl_divergence

from bam_pyro import AttentionGuide, BamConfig, BamModel, MultiHeadBayesianAttention, ObjectiveConfig
from bam_pyro.sites import SITE_INFO, attention_sites

META = torch.device("meta")
WC = BamConfig("wc", k=10.0, beta=1e-2, d_mid=3)
LC = BamConfig("lc", sigma_q=0.5, sigma_p=2.0, d_mid=3)
#: the paper's extreme hyperparameters
EXTREME = {"wc": BamConfig("wc", k=1000.0, beta=1e-15, d_mid=3), "lc": BamConfig("lc", sigma_q=1e-6, sigma_p=1e15, d_mid=3),
           "wf": BamConfig("wf", k=1000.0, beta=1e-15, alpha=1e-15), "lf": BamConfig("lf", sigma_q=1e-6, sigma_p=1e15)}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _no_pyro_validation():
    """Pyro's validation checks values (supports, positive scales); it is the user's switch to pay
    for host reads, and meta has no values to check."""
    with pyro.validation_enabled(False):
        yield


@pytest.fixture
def edge_masks_keep_all_on_meta():
    """PyG's ``remove_self_loops`` (in GATConv too) selects edges with a boolean mask, a shape that
    depends on the values; on meta, torch assumes every edge is kept when told so."""
    from torch.fx.experimental import _config

    with _config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


def on(device, *tensors):
    return tuple(t.to(device) for t in tensors)


def elbo_terms(model, guide, *args, **kwargs) -> tuple[torch.Tensor, dict]:
    """``TraceMeanField_ELBO``'s loss, ``-sum log p(obs) + sum scale * KL(q || p)``, from the guide's
    traces (model and guide in one pass), and the traces' attention sites."""
    guide(*args, **kwargs)
    model_trace, guide_trace = guide.get_traces()
    model_trace.compute_log_prob()
    loss, sites = 0.0, {}
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample":
            continue
        if site["is_observed"]:
            loss = loss - site["log_prob_sum"]
            continue
        q = guide_trace.nodes[name]
        kl = kl_divergence(q["fn"], site["fn"]) * q["scale"]
        loss = loss + kl.sum()
        if SITE_INFO in (site.get("infer") or {}):
            sites[name] = (q, kl)
    return loss, sites


def check_training_step(model: BamModel, guide, device, *args, unused: tuple[str, ...] = (), **kwargs) -> torch.Tensor:
    """Model and guide's loss on ``device``, its gradient, and every attention site there (every
    parameter gets a gradient on ``device`` but those whose names start with one of ``unused``)."""
    loss, sites = elbo_terms(model.model, guide, *args, step=3, **kwargs)
    assert sites, "no attention site ran"
    for name, (q, kl) in sites.items():
        assert q["value"].device.type == torch.device(device).type, name
        assert kl.device.type == torch.device(device).type, name
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and not n.startswith(unused)]
    assert grads and all(g is not None and g.device.type == torch.device(device).type for g in grads)
    return loss


# --- the models -------------------------------------------------------------------------------


class DenseEncoder(nn.Module):
    def __init__(self, config: BamConfig, d_model: int = 16) -> None:
        super().__init__()
        self.attention = MultiHeadBayesianAttention(d_model, 2, config)
        self.head = nn.Linear(d_model, 3)

    def forward(self, x, valid):
        h, _ = self.attention(x, x, x, valid_keys=valid, valid_queries=valid)
        return self.head(h.mean(-2))


class DenseClassifier(BamModel):
    def likelihood(self, logits, y=None):
        self.observe("y", dist.Categorical(logits=self.align_to_plate(logits, 2)), y)


def dense_batch(dtype=torch.float32):
    x = torch.randn(4, 5, 16, dtype=dtype)
    valid = torch.ones(4, 5, dtype=torch.bool)
    valid[1, 3:] = False
    valid[2] = False  # an empty sequence: its weights are zero, its KL is zero
    return x, valid, torch.tensor([0, 1, 2, 1])


def dense_model(config: BamConfig, dtype=torch.float32) -> BamModel:
    return DenseClassifier(DenseEncoder(config), ObjectiveConfig(anneal_rate=0.1)).to(dtype)


def graph_model(conv: str, config: BamConfig) -> BamModel:
    from bam_pyro import pyg

    layer = getattr(pyg, conv)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = layer(6, 4, heads=2, config=config)
            self.conv2 = layer(8, 3, heads=1, config=config)

        def forward(self, x, edge_index):
            return self.conv2(F.elu(self.conv1(x, edge_index)), edge_index)

    return pyg.NodeClassifier(Net(), ObjectiveConfig(anneal_rate=0.1))


def graph_batch(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=g, dtype=dtype)
    edge_index = torch.randint(0, 10, (2, 30), generator=g)
    return x, edge_index, torch.randint(0, 3, (10,), generator=g), torch.arange(0, 10, 2)


# --- meta: each attention kind and each task's network and guide --------------------------------


@pytest.mark.parametrize("config", [WC, LC], ids=["wc", "lc"])
def test_dense_attention_trains_and_predicts_on_meta(config):
    model = dense_model(config).to(META).train()
    x, valid, y = on(META, *dense_batch())
    loss = check_training_step(model, AttentionGuide(model.model), META, x, valid, y=y)
    assert loss.device == META and loss.shape == ()
    model.eval()
    assert model.network(x, valid).device == META


class HostReads(TorchFunctionMode):
    """Counts the reads of a tensor's value on the host (each a synchronization on an accelerator)."""

    READS = {Tensor.item, Tensor.tolist, Tensor.numpy, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def values_not_at_hand(monkeypatch):
    """The CPU taken for an accelerator: the library's reads that are free on an eager CPU tensor
    (``bam_pyro.host_reads.values_at_hand``), and that it skips elsewhere, are skipped here too."""
    from bam_pyro import axes, host_reads, normalize

    for module in (axes, host_reads, normalize):
        monkeypatch.setattr(module, "values_at_hand", lambda t: False)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialized"])
def test_a_dense_bam_wc_training_step_reads_no_tensor_on_the_host(fused, values_not_at_hand):
    """Model and guide in one pass at an annealed step, with key padding, the loss from their
    traces, backward and an optimizer step: no value read on the host, as on an accelerator (Pyro's
    ELBOs add one read of their own, the loss's ``torch_item``, which this step leaves out as
    :func:`elbo_terms` does)."""
    from bam_pyro.attention import set_fused

    model = set_fused(dense_model(WC), fused).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, valid, y = dense_batch()
    guide = AttentionGuide(model.model)
    elbo_terms(model.model, guide, x, valid, y=y, step=0)  # lazy parameters made, first-call checks done
    for step in (1, 2):
        with HostReads() as counter:
            loss, sites = elbo_terms(model.model, guide, x, valid, y=y, step=step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert sites and counter.reads == [], counter.reads
    with HostReads() as counter:
        torch.tensor([1.0, 2.0]).sum().item()
    assert counter.reads == ["item"]  # the counter sees a read


@pytest.mark.parametrize("conv", ["BayesianGATConv", "BayesianGATv2Conv", "BayesianTransformerConv"])
def test_graph_attention_convs_train_and_predict_on_meta(conv, edge_masks_keep_all_on_meta):
    model = graph_model(conv, WC).to(META).train()
    x, edge_index, y, nodes = on(META, *graph_batch())
    check_training_step(model, AttentionGuide(model.model), META, x, edge_index, y=y, nodes=nodes)
    model.eval()
    assert model.network(x, edge_index).shape == (10, 3)


def test_the_papers_gat_trains_on_meta(edge_masks_keep_all_on_meta):
    """models.gat with the Cora preset's per-head input dropout (its sparse gather is CPU only)."""
    from models.gat import build_node_classifier

    model = build_node_classifier(6, 3, WC, ObjectiveConfig(anneal_rate=0.1), heads=2, hidden=4).to(META).train()
    x, edge_index, y, nodes = on(META, *graph_batch())
    check_training_step(model, AttentionGuide(model.model), META, x, edge_index, y=y, nodes=nodes)


def tiny_bert_model():
    from transformers import BertConfig, BertForSequenceClassification

    from bam_pyro.transformers import build_sequence_model

    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                        num_labels=3)
    return build_sequence_model(BertForSequenceClassification(config), 3, WC, ObjectiveConfig())


def test_transformers_bam_trains_on_meta_without_padding():
    model = tiny_bert_model().to(META).train()
    ids = torch.randint(5, 60, (3, 7), device=META)
    check_training_step(model, AttentionGuide(model.model), META, ids, None, labels=torch.tensor([0, 1, 2], device=META))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "materialized"])
def test_transformers_bam_trains_on_meta_with_padding(fused):
    """The mask transformers builds through bam_pyro's mask function says it is key padding: no
    attention call reads its values to tell."""
    from bam_pyro.attention import set_fused

    model = set_fused(tiny_bert_model(), fused).to(META).train()
    ids, mask = torch.randint(5, 60, (3, 7), device=META), torch.ones(3, 7, dtype=torch.long, device=META)
    check_training_step(model, AttentionGuide(model.model), META, ids, mask, labels=torch.tensor([0, 1, 2], device=META))


def test_vqa_network_and_guide_train_on_meta():
    from models.vqa import McanSizes, build_vqa_model

    sizes = McanSizes(hidden=16, heads=2, encoder_layers=1, decoder_layers=1, embedding=8, features=16, grid=4, dropout=0.1)
    model = build_vqa_model(10, 5, WC, ObjectiveConfig(), sizes=sizes).to(META).train()
    words = torch.tensor([[3, 4, 0], [5, 0, 0]], device=META)
    images = torch.empty(2, 3, 64, 64, dtype=torch.uint8, device=META)
    check_training_step(model, AttentionGuide(model.model), META, words, images, answers=torch.tensor([1, 2], device=META))


@pytest.mark.parametrize("config", [WC, LC], ids=["wc", "lc"])
def test_captioning_network_and_guide_train_on_meta(config):
    """Att2in: one Bayesian attention site per decoding step over the photo's grid, its words'
    likelihood in masked plates."""
    from models.captioning import Att2inSizes, build_captioner

    sizes = Att2inSizes(embedding=8, hidden=8, attention=5, dropout=0.1)
    model = build_captioner(12, 6, sizes, config, ObjectiveConfig()).to(META).train()
    features, grid_mask = torch.empty(2, 4, 6, device=META), torch.ones(2, 4, dtype=torch.bool, device=META)
    tgt_in = torch.tensor([[1, 5, 6], [1, 7, 0]], device=META)
    tgt_out = torch.tensor([[5, 6, 2], [7, 2, 0]], device=META)
    tgt_mask = torch.tensor([[True, True, True], [True, True, False]], device=META)
    check_training_step(model, AttentionGuide(model.model), META, features, grid_mask, tgt_in, tgt_mask, tgt_out=tgt_out)


def test_translation_attention_and_likelihood_run_on_meta():
    """models.nmt past its encoder (whose packed LSTM takes CPU lengths): the decoder, the Bayesian
    attention of all target steps, the output layer and the masked target plates."""
    from models.nmt import Memory, NetworkSizes, build_translator

    sizes = NetworkSizes(embedding=8, encoder=6, decoder=8, attention=5, layers=1, dropout=0.1)
    model = build_translator(11, sizes, WC, ObjectiveConfig()).to(META).train()
    network = model.network
    states = torch.randn(2, 4, 12, device=META)
    src_mask = torch.ones(2, 4, dtype=torch.bool, device=META)
    tgt_in, tgt_mask = torch.zeros(2, 3, dtype=torch.long, device=META), torch.ones(2, 3, dtype=torch.bool, device=META)

    def translation(tgt_out, step):
        with attention_sites(model.kl_scale(step), model.num_sites):
            memory = Memory(states, network.score_key(states), src_mask)
            outputs = network.decoder_states(memory, tgt_in)
            weights = network.attention_weights(outputs.scores, memory, tgt_mask)
            logits = network.generate(outputs.states, network.context(weights, memory))
        model.likelihood(logits, tgt_out=tgt_out, tgt_mask=tgt_mask)

    check_training_step(model, AttentionGuide(translation), META, tgt_out=tgt_in,
                        unused=("network.source_embedding", "network.encoder."))


class UnpackedSeq2Seq(nn.Module):
    """A latent-alignment network without packed sequences (see the module doc)."""

    def __init__(self, vocab: int = 9, size: int = 8) -> None:
        super().__init__()
        from models.nmt import DecoderOutputs, Memory  # noqa: F401  (the shapes the alignment model reads)

        self.vocab_size = vocab
        self.embedding = nn.Embedding(vocab, size)
        self.encoder = nn.LSTM(size, size, batch_first=True)
        self.decoder = nn.LSTM(size, size, batch_first=True)
        self.score_key = nn.Linear(size, size)
        self.output = nn.Linear(2 * size, vocab)

    def encode(self, src, src_mask):
        from models.nmt import Memory

        states = self.encoder(self.embedding(src))[0]
        return Memory(states, self.score_key(states), src_mask)

    def decoder_states(self, memory, tgt_in):
        from models.nmt import DecoderOutputs

        states = self.decoder(self.embedding(tgt_in))[0]
        scores = states @ memory.keys.transpose(-1, -2)
        return DecoderOutputs(states, scores, scores.softmax(-1) @ memory.states)

    def generate(self, states, contexts):
        return self.output(torch.cat(torch.broadcast_tensors(states, contexts), -1))


@pytest.mark.parametrize("variant", ["exact", "hard", "hard-enum", "va-enum", "va-sample"])
def test_latent_alignment_models_and_guides_run_on_meta(variant):
    """The alignment model and its guides (guides.alignment's inference network packs its LSTMs,
    so the variational guide's scores come from a stand-in of the same shape). va-relaxed is left
    out: torch has no meta kernel for Dirichlet sampling (``aten::_sample_dirichlet``)."""
    from bam_pyro.alignment import ALIGNMENT_VARIANTS, AlignmentConfig, LatentAlignmentModel, guide_for

    class Scores(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(()))

        def forward(self, src, src_mask, tgt_out, tgt_mask):
            return self.weight * torch.ones(*tgt_out.shape, src.size(1), device=src.device)

    inference = Scores() if ALIGNMENT_VARIANTS[variant].guide == "inference" else None
    model = LatentAlignmentModel(UnpackedSeq2Seq(), ObjectiveConfig(), AlignmentConfig(variant), inference)
    model = model.to(META).train()
    src, tgt = torch.randint(3, 9, (2, 4), device=META), torch.randint(3, 9, (2, 3), device=META)
    src_mask, tgt_mask = torch.ones(2, 4, dtype=torch.bool, device=META), torch.ones(2, 3, dtype=torch.bool, device=META)
    guide = guide_for(model)
    args = (src, src_mask, tgt, tgt_mask, tgt)
    enumerated = ALIGNMENT_VARIANTS[variant].enumerate
    guide_trace = poutine.trace(poutine.enum(guide, first_available_dim=-3) if enumerated else guide).get_trace(*args)
    replayed = poutine.replay(model.model, trace=guide_trace)
    model_trace = poutine.trace(poutine.enum(replayed, first_available_dim=-3) if enumerated else replayed).get_trace(*args)
    model_trace.compute_log_prob()
    guide_trace.compute_log_prob()
    loss = -sum(site["log_prob_sum"] for site in model_trace.nodes.values() if site["type"] == "sample")
    loss = loss + sum(site["log_prob_sum"] for site in guide_trace.nodes.values() if site["type"] == "sample")
    assert loss.device == META
    loss.backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters() if p.requires_grad)


# --- dtypes: what the library makes follows its inputs --------------------------------------------


@pytest.mark.parametrize("config", [WC, LC], ids=["wc", "lc"])
def test_float64_inputs_give_float64_sites_weights_and_kl(config):
    model = dense_model(config, torch.float64).train()
    x, valid, y = dense_batch(torch.float64)
    loss, sites = elbo_terms(model.model, AttentionGuide(model.model), x, valid, y=y, step=0)
    assert loss.dtype == torch.float64
    for q, kl in sites.values():
        assert q["value"].dtype == q["infer"][SITE_INFO].phi.dtype == kl.dtype == torch.float64
    model.eval()
    _, weights = model.network.attention(x, x, x, valid_keys=valid)
    assert weights.dtype == torch.float64


@pytest.mark.parametrize("make", ["dense", "graph"])
def test_bfloat16_inputs_give_bfloat16_weights_with_a_float32_site(make):
    """A bfloat16 model's attention weights are bfloat16; Phi, S and the KL behind them float32."""
    if make == "dense":
        model = dense_model(WC, torch.bfloat16)
        x, valid, y = dense_batch(torch.bfloat16)
        args, kwargs = (x, valid), {"y": y}
        weights = lambda: model.network.attention(x, x, x, valid_keys=valid)[1]  # noqa: E731
    else:
        model = graph_model("BayesianGATConv", WC).to(torch.bfloat16)
        x, edge_index, y, nodes = graph_batch(torch.bfloat16)
        args, kwargs = (x, edge_index), {"y": y, "nodes": nodes}
        weights = lambda: model.network.conv1(x, edge_index, return_attention_weights=True)[1][1]  # noqa: E731
    model.train()
    loss, sites = elbo_terms(model.model, AttentionGuide(model.model), *args, step=0, **kwargs)
    for q, kl in sites.values():
        assert q["value"].dtype == kl.dtype == torch.float32
    assert torch.isfinite(loss)
    assert weights().dtype == torch.bfloat16


# --- bf16-mixed: the KL and the normalization stay float32, finite at the paper's extremes -------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, cuda])])
@pytest.mark.parametrize("variant", sorted(EXTREME))
@pytest.mark.parametrize("make", ["dense", "graph"])
def test_bf16_autocast_keeps_the_kl_and_normalization_float32_and_finite(variant, make, device):
    config = EXTREME[variant]
    if make == "dense":
        model = dense_model(config).to(device)
        x, valid, y = on(device, *dense_batch())
        args, kwargs = (x, valid), {"y": y}
    else:
        model = graph_model("BayesianGATConv", config).to(device)
        x, edge_index, y, nodes = on(device, *graph_batch())
        args, kwargs = (x, edge_index), {"y": y, "nodes": nodes}
    model.train()
    model.record_attention = True
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        guide = AttentionGuide(model.model)
        loss, sites = elbo_terms(model.model, guide, *args, step=3, **kwargs)
        model_trace, _ = guide.get_traces()
    for name, (q, kl) in sites.items():
        assert q["infer"][SITE_INFO].phi.dtype == q["value"].dtype == kl.dtype == torch.float32, name
        assert model_trace.nodes[f"{name}.weights"]["value"].dtype == torch.float32, name  # normalized in float32
        assert torch.isfinite(kl).all(), name
    assert torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- CUDA: the same checks on a GPU ----------------------------------------------------------------


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("config", [WC, LC], ids=["wc", "lc"])
def test_dense_attention_trains_on_cuda(config):
    model = dense_model(config).to("cuda").train()
    x, valid, y = on("cuda", *dense_batch())
    loss = check_training_step(model, AttentionGuide(model.model), "cuda", x, valid, y=y)
    assert torch.isfinite(loss)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("conv", ["BayesianGATConv", "BayesianGATv2Conv", "BayesianTransformerConv"])
def test_graph_attention_convs_train_on_cuda(conv):
    model = graph_model(conv, WC).to("cuda").train()
    x, edge_index, y, nodes = on("cuda", *graph_batch())
    loss = check_training_step(model, AttentionGuide(model.model), "cuda", x, edge_index, y=y, nodes=nodes)
    assert torch.isfinite(loss)


@pytest.mark.cuda
@cuda
def test_cuda_attention_equals_cpu_attention_in_eval_mode():
    model = dense_model(WC).eval()
    x, valid, _ = dense_batch()
    expected = model.network(x, valid)
    got = model.to("cuda").network(x.cuda(), valid.cuda())
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-4)
