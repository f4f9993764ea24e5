"""What users of PyTorch, Pyro and transformers call next on this library's objects, with the
meaning their own library gives those calls: eval mode after conversion, the param store's save
and load, vectorized ``Predictive``, the JIT ELBOs, PyTorch's mask shapes and conventions."""

import copy
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import JitTrace_ELBO, JitTraceMeanField_ELBO, Predictive, TraceMeanField_ELBO
from transformers import BertConfig, BertForSequenceClassification

from bam_pyro import AttentionGuide, BamConfig, MultiHeadBayesianAttention, ObjectiveConfig
from bam_pyro import dense
from bam_pyro.predictive import predictive_draws
from bam_pyro.pyg import NodeClassifier
from bam_pyro.transformers import build_sequence_model, to_bam
from models.gat import GAT

from .conftest import random_graph
from .test_elbo import _Encoder, _SequenceClassifier

ROOT = Path(__file__).resolve().parents[1]
WC = BamConfig("wc", k=10.0, beta=1e-2, d_mid=5)
STOCHASTIC = ["wc", "wf", "lc", "lf", "nokl"]


@pytest.fixture(autouse=True)
def _fresh_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def tiny_bert(num_labels: int = 3) -> BertForSequenceClassification:
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, num_labels=num_labels, initializer_range=0.3)  # outputs that attention moves
    return BertForSequenceClassification(config).eval()  # as from_pretrained returns it


def padded_batch():
    ids = torch.randint(5, 60, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    return ids, mask


# 1. to_bam keeps the model's mode


def test_a_model_converted_in_eval_mode_predicts_the_posterior_mean():
    original = tiny_bert()
    model = to_bam(copy.deepcopy(original), WC)
    assert not any(m.training for m in model.modules())
    ids, mask = padded_batch()
    with torch.no_grad():
        first, second = (model(input_ids=ids, attention_mask=mask).logits for _ in range(2))
        expected = original(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(first, second)
    torch.testing.assert_close(first, expected, atol=1e-5, rtol=1e-5)


def test_a_model_converted_in_training_mode_samples():
    model = to_bam(tiny_bert().train(), WC)
    assert all(m.training for m in model.modules())


# 2. Pyro's param store round trip

_TRAIN = """
import pyro, torch
from pyro.infer import SVI
from pyro.optim import Adam
from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.elbo import AttentionMeanFieldELBO
from bam_pyro.pyg import NodeClassifier
from models.gat import GAT
from tests.conftest import random_graph
x, edge_index, y = random_graph()
torch.manual_seed({seed})
model = NodeClassifier(GAT(12, 3, BamConfig("wc", k=10.0), hidden=8, heads=2, dropout=0.0), ObjectiveConfig())
"""


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_param_store_round_trip_restores_the_trained_model_in_a_new_process(tmp_path):
    store, outputs = tmp_path / "store.pt", tmp_path / "outputs.pt"
    _run(_TRAIN.format(seed=0) + f"""
svi = SVI(model.model, AttentionGuide(model.model), Adam({{"lr": 0.05}}), AttentionMeanFieldELBO())
for _ in range(5):
    svi.step(x, edge_index, y=y)
pyro.get_param_store().save({str(store)!r})
with torch.no_grad():
    torch.save(model.eval().network(x, edge_index), {str(outputs)!r})
""")
    _run(_TRAIN.format(seed=1) + f"""
pyro.get_param_store().load({str(store)!r})
trained = torch.load({str(outputs)!r})
with torch.no_grad():
    assert (model.eval().network(x, edge_index) - trained).abs().max() > 1e-2  # a fresh model differs
    model.model(x, edge_index)  # as pyro.module does: the loaded values are copied into the module
    assert torch.allclose(model.network(x, edge_index), trained, atol=1e-5, rtol=0)
store = pyro.get_param_store()
assert all(store["bam$$$" + name] is p for name, p in model.named_parameters())  # the store trains the module's tensors
""")


def test_a_stored_value_of_another_shape_is_refused_by_name():
    x, edge_index, _ = random_graph()
    model = NodeClassifier(GAT(12, 3, WC, hidden=8, heads=2, dropout=0.0), ObjectiveConfig())
    pyro.get_param_store()["bam$$$network.conv1.lin.weight"] = torch.zeros(3, 3)  # as a load of another model leaves it
    with pytest.raises(ValueError, match=r"bam\$\$\$network\.conv1\.lin\.weight.*\(3, 3\).*clear_param_store"):
        model.model(x, edge_index)


# 3. vectorized posterior draws on a transformers model


@pytest.mark.parametrize("fused", [True, False])
def test_parallel_predictive_draws_of_a_transformers_model(fused):
    from bam_pyro.attention import set_fused

    bam_model = build_sequence_model(tiny_bert(), 3, WC, ObjectiveConfig()).eval()
    set_fused(bam_model, fused)
    ids, mask = padded_batch()
    guide = AttentionGuide(bam_model.model)
    torch.manual_seed(1)
    draws = Predictive(guide, num_samples=5, parallel=True, return_sites=["labels"])(ids, mask)
    assert draws["labels"].shape == (5, 3)
    bam_model.record_attention = True
    draws = Predictive(bam_model.model, guide=guide, num_samples=4, parallel=True,
                       return_sites=["labels", "model.bert.encoder.layer.1.attention.self.bam_attention.weights"])(ids, mask)
    weights = draws["model.bert.encoder.layer.1.attention.self.bam_attention.weights"]
    assert draws["labels"].shape == (4, 3) and weights.shape == (4, 1, 3, 4, 7, 7)
    assert not torch.allclose(weights[0], weights[1])  # every draw its own
    assert (weights[:, :, 1, ..., 4:] == 0).all()  # the padding stays masked in each draw


@pytest.mark.parametrize("fused", [True, False])
def test_predictive_draws_of_a_transformers_model_at_the_default_chunk_size(fused):
    from bam_pyro.attention import set_fused

    ids, mask = padded_batch()
    for k, varies in ((10.0, True), (1e6, False)):  # at k = 1e6 every draw is the posterior mean
        bam_model = set_fused(build_sequence_model(tiny_bert(), 3, BamConfig("wc", k=k, beta=1e-2, d_mid=5), ObjectiveConfig()), fused)
        draws = predictive_draws(bam_model, (ids, mask), num_samples=6)
        assert draws.probs.shape == (6, 3, 3)
        with torch.no_grad():
            mean = bam_model.eval().network(ids, mask).softmax(-1)
        assert torch.allclose(draws.probs, mean.expand(6, 3, 3), atol=1e-4) != varies
        assert torch.allclose(draws.probs[0], draws.probs[1]) != varies


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("num_samples", [1, 4])
def test_each_vectorized_draw_is_the_model_given_that_draws_attention(fused, num_samples):
    """Every draw of a vectorized pass (folded into the batch) gives the logits of the model run
    alone on that draw's attention values (the fused path's seeds, the materialized path's S): no
    draw or batch row mixed with another, no axis of the attention output misplaced. Predictive's
    plate of one draw counts too: GLUE's draws, taken one per pass, once came out as noise."""
    from bam_pyro.attention import set_fused
    from bam_pyro.predictive import attention_site_names

    bam_model = set_fused(build_sequence_model(tiny_bert(), 3, WC, ObjectiveConfig()), fused).eval()
    ids, mask = padded_batch()

    def program(ids, mask):
        pyro.deterministic("logits", bam_model.model(ids, mask), event_dim=2)

    with torch.no_grad():
        trace = Predictive(AttentionGuide(program), num_samples=num_samples, parallel=True).get_vectorized_trace(ids, mask)
        drawn = trace.nodes["logits"]["value"].reshape(num_samples, 3, 3)
        sites = attention_site_names(bam_model)
        assert len(sites) == 2 and all(name in trace.nodes for name in sites)
        for j in range(num_samples):  # the values carry Predictive's plate and the data plate's slot: [draws, 1, ...]
            given = {name: trace.nodes[name]["value"][j, 0] for name in sites}
            alone = poutine.condition(bam_model.model, data=given)(ids, mask)
            torch.testing.assert_close(drawn[j], alone, atol=1e-5, rtol=1e-5)
        mean = bam_model.network(ids, mask)
    assert (drawn - mean).abs().max() > 1e-3  # k = 10: the draws are not the posterior mean


def test_vectorized_particles_weigh_the_kl_of_a_transformers_model_as_one_particle():
    bam_model = build_sequence_model(tiny_bert(), 3, BamConfig("wc", k=1e6, beta=1e-2, d_mid=5), ObjectiveConfig())
    bam_model.eval()  # no dropout: at k = 1e6 the particles then agree
    ids, mask = padded_batch()
    labels = torch.tensor([0, 1, 2])
    losses = [
        TraceMeanField_ELBO(num_particles=n, vectorize_particles=True, max_plate_nesting=1)
        .differentiable_loss(bam_model.model, AttentionGuide(bam_model.model), ids, mask, labels=labels).item()
        for n in (1, 3)
    ]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


class _FusedEncoder(torch.nn.Module):
    """Two stacked dense layers on the fused path (need_weights=False)."""

    def __init__(self):
        super().__init__()
        self.lower, self.upper = (MultiHeadBayesianAttention(16, 4, WC) for _ in range(2))
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x):
        h, _ = self.lower(x, x, x, need_weights=False)
        h, _ = self.upper(h, h, h, need_weights=False)
        return self.head(h.mean(-2))


def test_vectorized_prior_predictive_on_the_fused_path():
    """Without a guide each fused site draws S from the prior; a layer above another's draws
    carries their sample dims already, and must not get them a second time."""
    dense = _SequenceClassifier(_FusedEncoder(), ObjectiveConfig()).eval()
    draws = Predictive(dense.model, num_samples=3, parallel=True, return_sites=["y"])(torch.randn(4, 5, 16))
    assert draws["y"].shape == (3, 4)
    bert = build_sequence_model(tiny_bert(), 3, WC, ObjectiveConfig()).eval()
    draws = Predictive(bert.model, num_samples=3, parallel=True, return_sites=["labels"])(*padded_batch())
    assert draws["labels"].shape == (3, 3)


# 4. Pyro's JIT ELBOs


@pytest.mark.parametrize("elbo", [JitTrace_ELBO, JitTraceMeanField_ELBO])
@pytest.mark.parametrize("variant", STOCHASTIC)
def test_the_jit_elbos_are_refused_by_name(elbo, variant):
    x, valid = torch.randn(4, 5, 16), torch.ones(4, 5, dtype=torch.bool)
    network = _Encoder()
    for module in network.modules():
        if isinstance(module, MultiHeadBayesianAttention):
            module.attention.config = BamConfig(variant)
    model = _SequenceClassifier(network, ObjectiveConfig())
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace.*JitTrace.*TraceMeanField_ELBO"):
        elbo().loss_and_grads(model.model, AttentionGuide(model.model), x, valid, y=torch.zeros(4, dtype=torch.long))


# 5. mask shapes


def test_a_key_mask_of_pytorch_shape_is_read_as_pytorch_documents_it():
    attention = MultiHeadBayesianAttention(32, 4, WC).eval()
    x = torch.randn(16, 7, 32)
    valid = torch.rand(16, 7) > 0.3
    valid[:, 0] = True
    out, weights = attention(x, x, x, valid_keys=valid)
    assert out.shape == (16, 7, 32) and weights.shape == (16, 4, 7, 7)
    assert (weights.masked_select(~valid[:, None, None, :]) == 0).all()
    shared, _ = attention(x, x, x, valid_keys=valid[0])  # one [L] mask for every sequence, as PyTorch's unbatched form
    alone, _ = attention(x, x, x, valid_keys=valid[0].expand(16, 7))
    assert torch.equal(shared, alone)


@pytest.mark.parametrize("argument,shape", [("valid_keys", (16, 1, 7)), ("valid_keys", (1, 16, 7)),
                                            ("valid_queries", (16, 1, 7)), ("valid_keys", (4, 7))])
def test_a_mask_that_would_grow_the_batch_is_refused_by_name(argument, shape):
    attention = MultiHeadBayesianAttention(32, 4, WC)
    x = torch.randn(16, 7, 32)
    with pytest.raises(ValueError, match=rf"^{argument} of shape \({shape[0]}, .*expected \[16, 7\] or \[7\]"):
        attention(x, x, x, **{argument: torch.ones(shape, dtype=torch.bool)})


# 6. the mask argument that cannot be mistaken for PyTorch's


def test_key_padding_mask_keeps_its_old_meaning_and_warns_once(monkeypatch):
    monkeypatch.setattr(dense, "_warned", set())
    attention = MultiHeadBayesianAttention(32, 4, WC).eval()
    x = torch.randn(2, 5, 32)
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    expected, _ = attention(x, x, x, valid_keys=valid, valid_queries=valid)
    with pytest.warns(FutureWarning) as record:
        old, _ = attention(x, x, x, key_padding_mask=valid, query_padding_mask=valid)
    messages = [str(warning.message) for warning in record]
    assert len(messages) == 2
    assert re.match(r"key_padding_mask \(True = valid\).*opposite of torch\.nn\.MultiheadAttention.*valid_keys=$", messages[0])
    assert re.match(r"query_padding_mask \(True = valid\).*valid_queries=$", messages[1])
    assert torch.equal(old, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention(x, x, x, key_padding_mask=valid, query_padding_mask=valid)  # once
    with pytest.raises(TypeError, match="both valid_keys and key_padding_mask"):
        attention(x, x, x, valid_keys=valid, key_padding_mask=valid)


# smaller ones


def test_gpt2_returns_the_maps_asked_for():
    """GPT-2 takes output_attentions off before its attention modules run (its output capturing
    records what they return): the maps must still be materialized, as BERT's are."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    original = GPT2Model(config).eval()
    model = to_bam(copy.deepcopy(original), WC)
    ids = torch.randint(0, 60, (2, 5))
    with torch.no_grad():
        maps = model(input_ids=ids, output_attentions=True).attentions
        original.set_attn_implementation("eager")
        expected = original(input_ids=ids, output_attentions=True).attentions
    assert len(maps) == 2
    for got, want in zip(maps, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_node_classifier_checks_the_graph():
    x, edge_index, _ = random_graph(num_nodes=30)
    model = NodeClassifier(GAT(12, 3, WC, hidden=8, heads=2, dropout=0.0), ObjectiveConfig())
    edge_index[0, 3] = 30
    with pytest.raises(ValueError, match=r"edge_index refers to nodes outside \[0, 30\)"):
        model.model(x, edge_index)
