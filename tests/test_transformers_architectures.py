"""Bayesian attention in architectures beyond BERT: T5's relative position bias, Gemma 2's
soft-capped scores, encoder-decoders whose two sides have their own head counts (Bart), decoders
(Qwen3), vision encoders (ViT, DINOv2) and ModernBERT, whose attention takes its scaling as an
argument and alternates global and sliding-window layers."""

import copy

import pyro.distributions as dist
from pyro import poutine
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO
from torch import nn
import transformers
from transformers import (
    BartConfig, BartForConditionalGeneration, Dinov2Config, Dinov2Model, Gemma2Config, Gemma2Model, Qwen3Config, Qwen3Model,
    T5Config, T5ForConditionalGeneration, ViTConfig, ViTModel,
)

from bam_pyro import AttentionGuide, BamConfig, BamModel, ObjectiveConfig
from bam_pyro.attention import set_fused
from bam_pyro.sites import SITE_INFO
from bam_pyro.transformers import BAM_ATTRIBUTE, bam_attention_forward, to_bam
from bam_pyro.transformers.convert import attach_bayesian_attention, calls_attention_interface

WC = BamConfig("wc", k=10.0, beta=1e-2, d_mid=5)


def tiny_t5():
    config = T5Config(vocab_size=60, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config).eval()


def tiny_bart():
    config = BartConfig(vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=32)
    return BartForConditionalGeneration(config).eval()


def batch():
    ids = torch.randint(3, 60, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    return ids, mask, torch.randint(3, 60, (3, 5))


def eager_copy(model):
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return eager


class Seq2SeqNetwork(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask, decoder_ids):
        return self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits


class NextTokens(BamModel):
    def likelihood(self, logits, targets=None):
        self.observe("targets", dist.Categorical(logits=logits).to_event(1), targets)


@pytest.mark.parametrize("make", [tiny_t5, tiny_bart], ids=["t5", "bart"])
def test_encoder_decoder_in_eval_mode_is_its_own_attention(make):
    """T5 adds its relative position bias to the scores (0.13 off if dropped); Bart's decoder has
    2 heads where its encoder has 4."""
    original = make()
    bam = to_bam(copy.deepcopy(original), WC).eval()
    ids, mask, decoder_ids = batch()
    with torch.no_grad():
        expected = eager_copy(original)(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        got = bam(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [tiny_t5, tiny_bart], ids=["t5", "bart"])
def test_cross_attention_has_a_prior_of_its_own_size_and_trains(make):
    bam = to_bam(make(), WC)
    bam_model = NextTokens(Seq2SeqNetwork(bam), ObjectiveConfig())
    bam_model.train()
    ids, mask, decoder_ids = batch()
    guide = AttentionGuide(bam_model.model)
    loss = TraceMeanField_ELBO().differentiable_loss(bam_model.model, guide, ids, mask, decoder_ids,
                                                     targets=torch.randint(3, 60, (3, 5)))
    loss.backward()
    model_trace, _ = guide.get_traces()
    sites = [n for n, s in model_trace.nodes.items() if SITE_INFO in (s.get("infer") or {})]
    assert len(sites) == 6 and sum("EncDecAttention" in n or "encoder_attn" in n for n in sites) == 2
    priors = {n: p for n, p in bam.named_parameters() if ".prior_net." in n}
    assert len(priors) == 18 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in priors.values())


@pytest.mark.parametrize("make", [tiny_t5, tiny_bart], ids=["t5", "bart"])
def test_cross_attention_keeps_every_decoder_query_whatever_the_encoders_padding(make):
    """Decoder and encoder of equal length: the encoder's padding masks cross-attention's keys, not
    its queries (decoder positions), which all count in the KL; the encoder's self-attention drops
    its padded queries."""
    bam_model = NextTokens(Seq2SeqNetwork(set_fused(to_bam(make(), WC), False)), ObjectiveConfig())  # entry masks to read
    bam_model.train()
    ids, mask, _ = batch()
    decoder_ids = torch.randint(3, 60, ids.shape)  # as long as the source
    trace = poutine.trace(bam_model.model).get_trace(ids, mask, decoder_ids)
    checked = {"cross": 0, "encoder": 0}
    for name, site in trace.nodes.items():
        if SITE_INFO not in (site.get("infer") or {}):
            continue
        valid_queries = site["fn"].mask.expand(3, 1, 7, 7).any(-1)[1, 0]  # sequence 1: 4 real source tokens
        if "EncDecAttention" in name or "encoder_attn" in name:
            assert valid_queries.all(), name
            checked["cross"] += 1
        elif ".encoder." in name:
            assert valid_queries.tolist() == [True] * 4 + [False] * 3, name
            checked["encoder"] += 1
    assert checked == {"cross": 2, "encoder": 2}


def test_each_side_of_bart_sizes_its_priors_by_its_own_heads():
    bam = to_bam(tiny_bart(), WC)
    heads = {n: m.prior_net.hidden_weight.shape[0] for n, m in bam.named_modules() if n.endswith(BAM_ATTRIBUTE)}
    assert len(heads) == 6
    assert all(h == (4 if n.startswith("model.encoder.") else 2) for n, h in heads.items())


def test_soft_capped_scores_match_eager_attention():
    """Gemma 2 caps its scores (softcap * tanh(scores / softcap)) before the softmax, with
    grouped-query attention and a sliding window besides."""
    config = Gemma2Config(vocab_size=60, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, attn_logit_softcapping=2.0, sliding_window=4)
    original = Gemma2Model(config).eval()
    with torch.no_grad():  # scores of several units, where the cap bends them
        for layer in original.layers:
            layer.self_attn.q_proj.weight.mul_(100.0)
    bam = to_bam(copy.deepcopy(original), WC).eval()
    ids, mask, _ = batch()
    valid = mask.bool()
    with torch.no_grad():
        expected = eager_copy(original)(input_ids=ids, attention_mask=mask).last_hidden_state
        got = bam(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)


def test_attention_sinks_are_refused():
    """A sink logit joins each softmax without a key (GPT-OSS's ``s_aux``): not implemented, and
    ignoring it would change the weights without a word."""
    module = nn.Module()
    setattr(module, BAM_ATTRIBUTE, nn.Identity())
    query = key = value = torch.zeros(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="s_aux= \\(attention sinks\\)"):
        bam_attention_forward(module, query, key, value, None, s_aux=torch.zeros(2))


def tiny_modernbert():
    """Three layers: global attention in the first and third, a sliding window of 4 in the second."""
    config = transformers.ModernBertConfig(
        vocab_size=60, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, hidden_size=32,
        intermediate_size=37, num_hidden_layers=3, num_attention_heads=4, global_attn_every_n_layers=2, local_attention=4)
    return transformers.ModernBertModel(config).eval()


def tiny_qwen3():
    config = Qwen3Config(vocab_size=60, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8)
    return Qwen3Model(config).eval()


def tiny_vit():
    return ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                              image_size=16, patch_size=4)).eval()


def tiny_dinov2():
    return Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=1,
                                    image_size=16, patch_size=4)).eval()


def last_hidden_state(model, inputs):
    with torch.no_grad():
        return model(**inputs).last_hidden_state


@pytest.mark.parametrize("make", [tiny_modernbert, tiny_qwen3, tiny_vit, tiny_dinov2],
                         ids=["modernbert", "qwen3", "vit", "dinov2"])
@pytest.mark.parametrize("config", [BamConfig("soft"), WC], ids=["soft", "wc-eval"])
def test_every_attention_module_converts_and_equals_eager_attention(make, config):
    """Soft attention, and BAM's posterior mean in eval mode, are the model's own attention: the
    sliding window of ModernBERT's local layers and the padding included."""
    original = make()
    bam = to_bam(copy.deepcopy(original), config).eval()
    converted = [n for n, m in bam.named_modules() if hasattr(m, BAM_ATTRIBUTE)]
    assert len(converted) == original.config.num_hidden_layers
    if isinstance(original, (ViTModel, Dinov2Model)):
        inputs, valid = {"pixel_values": torch.randn(2, 3, 16, 16)}, slice(None)
    else:
        ids, mask, _ = batch()
        ids = torch.cat([ids, ids], dim=1)  # 14 tokens: longer than ModernBERT's window of 4
        mask = torch.cat([mask, mask], dim=1)
        inputs, valid = {"input_ids": ids, "attention_mask": mask}, mask.bool()
    torch.testing.assert_close(last_hidden_state(bam, inputs)[valid], last_hidden_state(eager_copy(original), inputs)[valid],
                               atol=1e-5, rtol=1e-5)


def test_modules_are_found_by_their_call_of_the_attention_interface_not_by_their_attributes():
    class Lookalike(nn.Module):
        """Head layout and scaling, but no attention function of transformers."""

        def __init__(self):
            super().__init__()
            self.num_heads, self.head_dim, self.scaling = 4, 8, 8**-0.5

        def forward(self, x):
            return x

    modernbert = tiny_modernbert()
    assert calls_attention_interface(modernbert.layers[0].attn) and not hasattr(modernbert.layers[0].attn, "scaling")
    assert not calls_attention_interface(Lookalike()) and not calls_attention_interface(modernbert.layers[0].mlp)
    with pytest.raises(ValueError, match="found no attention module in Lookalike"):
        attach_bayesian_attention(Lookalike(), WC)
