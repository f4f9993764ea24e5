"""The fused path (no attention map in memory) against the materialized one, with the same noise:
outputs, gradients and KL, for both families, fixed and contextual priors, both prior scopes, key
padding, causal masks, grouped-query attention; eval mode against sdpa; the counter-based noise."""

import math

import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import TraceMeanField_ELBO
from torch.distributions import kl_divergence

from bam_pyro import AttentionGuide, BamConfig, BayesianAttention, DenseKeys, MultiHeadBayesianAttention, noise
from bam_pyro.attention_map import AttentionMap
from bam_pyro.distributions import variational_distribution
from bam_pyro.attention import set_fused
from bam_pyro.fused import chunk_noise, chunked_attention
from bam_pyro.fused_sites import DotProductCall, FusedPosterior, FusedPrior
from bam_pyro.normalize import log_normalized, normalize
from bam_pyro.sites import SITE_INFO, attention_sites

CONFIGS = {
    "wc": BamConfig("wc", k=3.0, beta=0.5, d_mid=4),
    "wc-psi": BamConfig("wc", k=3.0, beta=0.5, d_mid=4, gamma_shape="psi"),
    "wc-all-keys": BamConfig("wc", k=3.0, beta=0.5, d_mid=4, prior_scope="all_keys"),
    "wf": BamConfig("wf", k=2.0, beta=0.3, alpha=0.2),
    "lc": BamConfig("lc", sigma_q=0.7, sigma_p=1.5, d_mid=4),
    "lc-all-keys": BamConfig("lc", sigma_q=0.7, sigma_p=1.5, d_mid=4, prior_scope="all_keys"),
    "lf": BamConfig("lf", sigma_q=0.7, sigma_p=1.5, mu_p=-1.0),
}
B, H, LQ, LK, D = 2, 3, 5, 6, 4


def inputs(lq=LQ, lk=LK, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, lq, d, generator=g) * 0.6 / (d / D) ** 0.5).requires_grad_()
    k = torch.randn(B, H, lk, d, generator=g).requires_grad_()
    v = torch.randn(B, H, lk, d, generator=g).requires_grad_()
    return q, k, v


def masks(kind, lq=LQ, lk=LK):
    """(key_mask [B, 1, 1, Lk], query_mask [B, 1, Lq, 1], causal) of a mask kind."""
    key_mask = query_mask = None
    if kind in ("padding", "causal-padding"):
        key_mask = torch.ones(B, 1, 1, lk, dtype=torch.bool)
        key_mask[1, ..., 3:] = False
        if lq == lk:
            query_mask = key_mask.transpose(-1, -2)
    return key_mask, query_mask, kind.startswith("causal")


def materialized(layer, q, k, v, key_mask, query_mask, causal, seed, family_config):
    """The materialized path, by hand, with the fused path's noise: output and summed KL."""
    mask = key_mask
    if causal:
        tril = torch.ones(1, q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask = tril if mask is None else mask & tril
    axis = DenseKeys(mask, batch_shape=torch.Size([B]), query_mask=query_mask)
    phi = log_normalized(axis, q @ k.transpose(-1, -2))
    c = family_config
    constant = math.lgamma(1 + 1 / c.k) if c.family == "weibull" else 0.5 * c.sigma_q**2
    log_s = phi + noise.noise_map(torch.tensor(seed), phi.shape, c.family, c.k, c.sigma_q) - constant
    weights = normalize(axis, torch.exp(log_s))
    keys = k.transpose(-2, -3)
    qd = AttentionMap(variational_distribution(phi, c), axis.mask, axis.event_dim)
    pd = AttentionMap(layer.prior(phi, keys, axis), axis.mask, axis.event_dim)
    return weights @ v, kl_divergence(qd, pd)


def fused(layer, q, k, v, key_mask, query_mask, causal, seed):
    logits = layer._prior_logits(k.transpose(-2, -3), q.dtype).transpose(-1, -2) if layer.prior_net is not None else None
    call = DotProductCall(layer.config, q, k, v, key_mask=key_mask, query_mask=query_mask, causal=causal, batch_dims=1,
                          prior_logits=logits, build_prior=None)
    return call.attend(torch.tensor(seed)), call.kl()


def grads(tensors, loss):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal", "causal-padding"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_path_equals_the_materialized_one_with_the_same_noise(name, mask_kind):
    torch.manual_seed(0)
    config = CONFIGS[name]
    layer = BayesianAttention(config, H, D)
    q, k, v = inputs()
    key_mask, query_mask, causal = masks(mask_kind)
    probe = torch.randn(B, H, LQ, D)
    params = [q, k, v, *layer.parameters()]
    results = []
    for run in (materialized, fused):
        args = (layer, q, k, v, key_mask, query_mask, causal, 1234) + ((config,) if run is materialized else ())
        out, kl = run(*args)
        results.append((out, kl, grads(params, (out * probe).sum() + 0.1 * kl)))
    (out_m, kl_m, g_m), (out_f, kl_f, g_f) = results
    torch.testing.assert_close(out_f, out_m, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(kl_f, kl_m, atol=1e-4, rtol=1e-5)
    for got, expected in zip(g_f, g_m):
        if expected is None:
            assert got is None or got.abs().max() == 0
        else:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_chunks_and_dropout_replay_in_the_backward_pass():
    """Any chunking gives the same draw, and the gradient of a draw with dropout is that of the
    same computation written out (the backward pass regenerates noise and dropout mask)."""
    q, k, v = inputs(lq=7, lk=7)
    keys = noise.row_keys(torch.tensor(99), B, H)
    outs = [chunked_attention(q, k, v, keys, "weibull", k=2.0, dropout=0.3, chunk=c) for c in (1, 3, 7)]
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0])
        torch.testing.assert_close(lse, outs[0][1])
    out, lse = outs[0]
    # the same draw written out in torch ops, differentiated by autograd
    g = noise.noise_map(torch.tensor(99), torch.Size([B, H, 7, 7]), "weibull", k=2.0)
    kept = noise.noise_map(torch.tensor(99), torch.Size([B, H, 7, 7]), "weibull", stream=noise.DROPOUT_STREAM) >= 0.3
    scores = q @ k.transpose(-1, -2)
    expected = (torch.softmax(scores + g, -1) * kept / 0.7) @ v
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    probe, lse_probe = torch.randn_like(out), torch.randn_like(lse)
    got = grads([q, k, v], (out * probe).sum() + (lse * lse_probe).sum())
    want = grads([q, k, v], (expected * probe).sum() + (torch.logsumexp(scores, -1) * lse_probe).sum())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal-padding"])
@pytest.mark.parametrize("family", ["weibull", "lognormal"])
def test_small_maps_kept_for_the_backward_pass_give_the_regenerated_draw_and_gradients(family, mask_kind, monkeypatch):
    """An eager call with a small map keeps its scores, weights and dropout mask for the backward
    pass instead of drawing them again: the same output, normalizer and gradients as the chunked
    operators, which it does not call; without a gradient, or with a larger map, the operators."""
    import bam_pyro.fused as fused

    q, k, v = inputs(lq=7, lk=7)
    key_mask, _, causal = masks(mask_kind, 7, 7)
    keys = noise.row_keys(torch.tensor(5), B, H)
    probe, lse_probe = torch.randn(B, H, 7, D), torch.randn(B, H, 7)

    def attend(**chunking):
        out, lse = chunked_attention(q, k, v, keys, family, k=2.0, sigma=0.7, key_mask=key_mask, causal=causal,
                                     dropout=0.25, **chunking)
        return out, lse, grads([q, k, v], (out * probe).sum() + (lse * lse_probe).sum())

    operator_calls = []
    operator = fused._chunked_attention_op
    monkeypatch.setattr(fused, "_chunked_attention_op", lambda *a: operator_calls.append(1) or operator(*a))
    kept = attend()
    assert not operator_calls
    regenerated = attend(chunk=3)
    assert operator_calls
    for got, want in zip((kept[0], kept[1], *kept[2]), (regenerated[0], regenerated[1], *regenerated[2])):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    operator_calls.clear()
    with torch.no_grad():
        chunked_attention(q, k, v, keys, family, k=2.0, dropout=0.25)
    monkeypatch.setattr(fused, "STORED_ENTRIES", B * H * 7 * 7 - 1)
    torch.testing.assert_close(attend()[2][0], regenerated[2][0], atol=1e-6, rtol=1e-5)
    assert len(operator_calls) == 2


def test_noise_is_a_pure_function_of_its_counters_and_has_the_right_law():
    seed = torch.tensor(2**40 + 7)
    full = noise.noise_map(seed, torch.Size([2, 3, 40, 50]), "weibull", k=1.0)
    keys = noise.query_keys(noise.row_keys(seed, 2, 3), torch.arange(10, 20))
    part = noise.log_noise(noise.entry_bits(keys[..., None], torch.arange(50)), "weibull", 1.0, 1.0)
    assert torch.equal(part, full[:, :, 10:20])  # any block, any order
    assert not torch.equal(full, noise.noise_map(seed + 1, full.shape, "weibull"))
    assert not torch.equal(full[0], full[1]) and not torch.equal(full[:, 0], full[:, 1])
    # log of a unit exponential: mean -gamma, variance pi^2 / 6; the Gaussian: 0 and 1
    big = noise.noise_map(seed, torch.Size([4, 4, 100, 100]), "weibull", k=1.0).double()
    assert abs(big.mean() + 0.5772157) < 0.02 and abs(big.var() - math.pi**2 / 6) < 0.05
    gauss = noise.noise_map(seed, torch.Size([4, 4, 100, 100]), "lognormal", sigma=1.0).double()
    assert abs(gauss.mean()) < 0.02 and abs(gauss.var() - 1) < 0.03


def test_every_32_bit_word_gives_finite_noise_strictly_inside_the_documented_ranges():
    """The extreme words: all ones (whose uniform once rounded to exactly 1 in float32, a Gaussian
    of +inf: NaN weights in BAM-LC's GLUE finetuning) and all zeros, and a sweep of the top
    uniforms' words."""
    top = torch.arange(-2**8, 0, dtype=torch.int32)  # the 256 words whose top 24 bits are all ones
    words = torch.cat([top, torch.tensor([0, 2**31 - 1, -2**31], dtype=torch.int32)])
    u = noise.uniform(words)
    assert bool((u > 0).all() and (u < 1).all())
    gauss, gumbel = noise.gaussian(words), noise.gumbel_like(words)
    assert bool(torch.isfinite(gauss).all() and torch.isfinite(gumbel).all())
    assert gauss.abs().max() < 5.5 and gumbel.min() > -16.7 and gumbel.max() < 2.9
    assert torch.equal(noise.uniform(torch.tensor([-2**8 - 1], dtype=torch.int32)),  # below the top: as before
                       torch.tensor([(2**24 - 2 + 0.5) / 2**24], dtype=torch.float32))


@pytest.mark.parametrize("family", ["weibull", "lognormal"])
def test_noise_drawn_in_the_words_own_memory_is_the_noise_drawn_into_a_new_tensor(family):
    words = torch.cat([torch.randint(-2**31, 2**31 - 1, (4, 3, 257), dtype=torch.int32).flatten(),
                       torch.arange(-2**8, 0, dtype=torch.int32), torch.tensor([0, 2**31 - 1, -2**31], dtype=torch.int32)])
    expected = noise.log_noise(words, family, 2.0, 0.7)
    spent = words.clone()
    got = noise.log_noise(spent, family, 2.0, 0.7, inplace=True)
    assert got.data_ptr() == spent.data_ptr() and torch.equal(got, expected)
    assert torch.equal(noise.uniform(words.clone(), inplace=True), noise.uniform(words))
    assert torch.equal(noise.uniform(words.clone(), torch.float64, inplace=True), noise.uniform(words, torch.float64))


def test_seeds_come_from_torch_generator_so_a_resumed_run_draws_the_same():
    attn = MultiHeadBayesianAttention(8, 2, CONFIGS["wc"]).train()
    x = torch.randn(2, 5, 8)
    torch.manual_seed(3)
    first, _ = attn(x, x, x, need_weights=False)
    state = torch.get_rng_state()
    second, _ = attn(x, x, x, need_weights=False)
    torch.set_rng_state(state)  # a resumed run restores the generator
    again, _ = attn(x, x, x, need_weights=False)
    assert torch.equal(again, second) and not torch.equal(first, second)


@pytest.mark.parametrize("mask_kind", ["none", "padding"])
def test_eval_mode_is_sdpa(mask_kind):
    attn = MultiHeadBayesianAttention(8, 2, CONFIGS["wc"]).eval()
    x = torch.randn(2, 6, 8)
    valid = None
    if mask_kind == "padding":
        valid = torch.ones(2, 6, dtype=torch.bool)
        valid[1, 4:] = False
    fused_out, none = attn(x, x, x, valid_keys=valid, need_weights=False)
    materialized_out, weights = attn(x, x, x, valid_keys=valid)
    assert none is None and weights is not None
    torch.testing.assert_close(fused_out, materialized_out)
    heads = lambda t: t.unflatten(-1, (2, 4)).transpose(1, 2)  # noqa: E731
    q, k, v = heads(attn.query_proj(x)), heads(attn.key_proj(x)), heads(attn.value_proj(x))
    mask = None if valid is None else valid[:, None, None, :]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(-2)
    torch.testing.assert_close(fused_out, attn.out_proj(expected))


def pooled_classifier(config, fused_path):
    """A BamModel: one MultiHeadBayesianAttention over padded sequences, mean-pooled, classified."""
    from bam_pyro import BamModel, ObjectiveConfig
    import pyro.distributions as dist

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = MultiHeadBayesianAttention(8, 2, config)
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x, valid):
            h, _ = self.attention(x, x, x, valid_keys=valid, need_weights=not fused_path)
            return self.head(h.mean(-2))

    class Model(BamModel):
        def likelihood(self, logits, y=None):
            self.observe("y", dist.Categorical(logits=self.align_to_plate(logits, 2)), y)

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[2, 3:] = False
    return Model(Net(), ObjectiveConfig(kl_weight=0.5)), x, valid


def _site_losses(config, fused_path):
    """One TraceMeanField_ELBO loss and its gradients, on either path."""
    model, x, valid = pooled_classifier(config, fused_path)
    guide = AttentionGuide(model.model)
    loss = TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, valid, y=torch.tensor([0, 1, 1]))
    loss.backward()
    return model, guide, loss, x, valid


def test_predictive_draws_on_the_fused_path_and_maps_only_when_asked():
    """Vectorized posterior draws run the fused path (one seed per draw: distinct draws); asking
    for a layer's maps materializes them for that run, rows on the simplex, padding at zero."""
    from bam_pyro.predictive import predictive_draws

    model, x, valid = pooled_classifier(CONFIGS["wc"], fused_path=True)
    draws = predictive_draws(model, (x, valid), 6, chunk_size=3)
    assert draws.probs.shape == (6, 3, 2) and draws.attention == {}
    assert not torch.allclose(draws.probs[0], draws.probs[1])
    with_maps = predictive_draws(model, (x, valid), 4, layers=["attention.attention"])
    weights = with_maps.attention["attention.attention"]
    assert weights.shape == (4, 3, 2, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, 3, 2, 5))
    assert (weights[:, 2, ..., 3:] == 0).all()


@pytest.mark.parametrize("name", ["wc", "lf"])
def test_one_site_per_call_with_its_analytic_kl_under_trace_mean_field(name):
    config = CONFIGS[name]
    model, guide, loss, x, valid = _site_losses(config, fused_path=True)
    model_trace, guide_trace = guide.get_traces()
    sites = [n for n, s in model_trace.nodes.items() if SITE_INFO in (s.get("infer") or {})]
    assert sites == ["attention.attention"]
    q = guide_trace.nodes[sites[0]]["fn"]
    assert isinstance(q, FusedPosterior) and q.has_rsample
    seed = guide_trace.nodes[sites[0]]["value"]
    assert seed.dtype == torch.int64 and seed.shape == ()
    # the analytic KL is the materialized one of the same call; the Monte Carlo estimate, its
    # log-densities at the regenerated map, averages to it
    call = q.call
    qm, pm, _, _ = call.maps()
    torch.testing.assert_close(call.kl(), kl_divergence(qm, pm), rtol=1e-5, atol=1e-4)
    assert all(p.grad is not None for p in model.parameters())
    # the ELBO's KL term is the site's scale times the closed form (mean reduction: over valid entries)
    scale = guide_trace.nodes[sites[0]]["scale"]
    assert scale == pytest.approx(0.5 / call.num_valid())
    assert call.num_valid() == 2 * (5 * 5 * 2 + 5 * 3)  # 2 heads; the padded queries still see 3 keys


def test_model_without_guide_draws_attention_from_the_prior():
    config = CONFIGS["wc"]
    attn = MultiHeadBayesianAttention(8, 2, config).train()
    x = torch.randn(2, 5, 8)
    with poutine.trace() as tracer, attention_sites():
        out, _ = attn(x, x, x, need_weights=False)
    site = tracer.trace.nodes["attention"]
    assert site["value"].is_floating_point() and site["value"].shape == (2, 2, 5, 5)  # a prior map S
    assert torch.isfinite(out).all()
    assert torch.isfinite(site["fn"].log_prob(site["value"]))


def test_log_densities_of_regenerated_maps_average_to_the_closed_form_kl():
    """What a Monte Carlo ELBO (Trace_ELBO) reads, log q - log p at the map a seed regenerates,
    averages over seeds to the closed form."""
    config = BamConfig("lf", sigma_q=0.5, sigma_p=1.0)
    layer = BayesianAttention(config, H, D)
    q, k, v = inputs()
    q, k = q.detach(), k.detach()
    call = DotProductCall(config, q, k, v.detach(), key_mask=None, query_mask=None, causal=False, batch_dims=1,
                          prior_logits=None, build_prior=lambda phi, axis: layer.prior(phi, None, axis))
    call.attend(torch.tensor(0))
    posterior, prior = FusedPosterior(call), FusedPrior(call)
    seeds = noise.draw_seeds(torch.Size([400]))
    estimate = (posterior.log_prob(seeds) - prior.log_prob(seeds)).mean()
    assert estimate.item() == pytest.approx(call.kl().item(), rel=0.05)


def tiny_llama():
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2))


def tiny_bert():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=37, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0))


@pytest.mark.parametrize("make,padding", [(tiny_llama, "left"), (tiny_llama, None), (tiny_bert, "right")],
                         ids=["llama-gqa-causal-left-padding", "llama-gqa-causal", "bert-key-padding"])
@pytest.mark.parametrize("name", ["wc", "lc"])
def test_transformers_site_kl_is_the_materialized_one(make, padding, name):
    """The first layer's KL does not depend on the draw: fused (closed form from the layout that
    transformers' mask is read as) and materialized (entry-wise) agree; grouped-query heads,
    causal masks with left padding, and BERT's key padding with padded queries left out."""
    from bam_pyro.transformers import to_bam

    model = to_bam(make(), CONFIGS[name]).train()
    ids = torch.randint(5, 60, (2, 7))
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :2] = 0
    elif padding == "right":
        mask[1, 4:] = 0
    kls, kinds = [], []
    for enabled in (True, False):
        set_fused(model, enabled)

        def program():
            with attention_sites():
                model(input_ids=ids, attention_mask=mask)

        guide = AttentionGuide(program)
        guide()
        model_trace, guide_trace = guide.get_traces()
        (site,) = [n for n, s in model_trace.nodes.items() if SITE_INFO in (s.get("infer") or {})]
        kinds.append(type(guide_trace.nodes[site]["fn"]))
        kls.append(kl_divergence(guide_trace.nodes[site]["fn"], model_trace.nodes[site]["fn"]))
    assert kinds[0] is FusedPosterior and kinds[1] is AttentionMap
    torch.testing.assert_close(kls[0], kls[1], rtol=1e-5, atol=1e-3)


def test_encoder_decoder_sites_count_the_same_entries_on_both_paths():
    """BART: the encoder's self-attention drops its padded queries, cross-attention keeps every
    decoder query, the decoder's self-attention is causal; each site's mean-reduction scale
    (1 / its valid entries) is the materialized path's."""
    from transformers import BartConfig, BartForConditionalGeneration

    from bam_pyro.transformers import to_bam

    config = BartConfig(vocab_size=60, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=32,
                        dropout=0.0, attention_dropout=0.0)
    model = to_bam(BartForConditionalGeneration(config), CONFIGS["wc"]).train()
    ids = torch.randint(3, 60, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    decoder_ids = torch.randint(3, 60, (3, 7))
    scales = []
    for enabled in (True, False):
        set_fused(model, enabled)
        with poutine.trace() as tracer, attention_sites(mean_over_sites=1):
            model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        sites = {n: s for n, s in tracer.trace.nodes.items() if SITE_INFO in (s.get("infer") or {})}
        assert all(isinstance(s["fn"], FusedPrior) == enabled for s in sites.values())
        scales.append({n: s["scale"] for n, s in sites.items()})
    assert len(scales[0]) == 3 and scales[0].keys() == scales[1].keys()
    for name in scales[0]:
        assert scales[0][name] == pytest.approx(scales[1][name]), name


@pytest.mark.parametrize("family", ["weibull", "lognormal"])
def test_flex_score_mod_adds_the_chunked_noise(family):
    """The CUDA route's score_mod (the hash out of place, entry by entry) adds the noise that the
    chunked function hashes in place: evaluated here on index grids that broadcast as
    FlexAttention's vmap does."""
    from bam_pyro.fused import noise_score_mod

    keys = noise.row_keys(torch.tensor(5), B, H)
    b, h, q_idx, kv_idx = (torch.arange(n).reshape([-1 if i == axis else 1 for i in range(4)])
                           for axis, n in enumerate((B, H, 20, 30)))
    added = noise_score_mod(keys, 20, family, 2.0, 0.7)(torch.zeros(B, H, 20, 30), b, h, q_idx, kv_idx)
    drawn, _ = chunk_noise(keys, torch.arange(20), torch.arange(30), family, 2.0, 0.7, 0.0, torch.float32)
    assert torch.equal(added, drawn)


def test_flex_attention_takes_only_cuda_calls_without_dropout_and_with_heads_of_16_or_more():
    from bam_pyro.fused import flex_attention_fits

    class OnCuda(torch.Tensor):  # a CPU tensor that says it is on CUDA: the rule, without a GPU
        is_cuda = True

    def head(d, on_cuda=True):
        t = torch.zeros(1, 1, 2, d)
        return t.as_subclass(OnCuda) if on_cuda else t

    assert flex_attention_fits(head(16), head(16), dropout=0.0)
    assert flex_attention_fits(head(64), head(32), dropout=0.0)
    assert not flex_attention_fits(head(4), head(16), dropout=0.0)  # FlexAttention does not lower heads under 16
    assert not flex_attention_fits(head(16), head(8), dropout=0.0)
    assert not flex_attention_fits(head(16), head(16), dropout=0.1)  # FlexAttention has no dropout
    assert not flex_attention_fits(head(16, False), head(16, False), dropout=0.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family, mask_kind", [("weibull", "causal-padding"), ("lognormal", "padding"), ("weibull", "none")])
def test_flex_attention_route_equals_the_chunked_function_on_cuda(family, mask_kind):
    """FlexAttention with the hashed noise in its score_mod: the same output, normalizer and
    gradients as the chunked function (the same counters), forward and backward. Heads of 16
    dimensions, FlexAttention's smallest."""
    from bam_pyro.fused import FLEX_MIN_HEAD_DIM, flex_attention_route

    q, k, v = (t.detach().cuda().requires_grad_() for t in inputs(lq=130, lk=130, d=FLEX_MIN_HEAD_DIM))
    key_mask, _, causal = masks(mask_kind, 130, 130)
    key_mask = None if key_mask is None else key_mask.cuda()
    keys = noise.row_keys(torch.tensor(5, device="cuda"), B, H)
    probe = torch.randn(B, H, 130, FLEX_MIN_HEAD_DIM, device="cuda")
    results = []
    for route in (chunked_attention, flex_attention_route):
        out, lse = route(q, k, v, keys, family, k=2.0, sigma=0.7, key_mask=key_mask, causal=causal)
        results.append((out, lse, grads([q, k, v], (out * probe).sum() + lse.sum())))
    (out_c, lse_c, g_c), (out_f, lse_f, g_f) = results
    torch.testing.assert_close(out_f, out_c, atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(lse_f, lse_c, atol=2e-4, rtol=1e-3)
    for a, b in zip(g_f, g_c):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.slow  # Inductor compiles the noise chain: a minute or more on 2 CPU cores
def test_compiled_noise_gives_the_eager_draw():
    from bam_pyro.fused import compile_noise

    q, k, v = inputs(lq=9, lk=9)
    keys = noise.row_keys(torch.tensor(11), B, H)
    results = []
    for compiled in (False, True):
        with compile_noise(compiled):
            out, lse = chunked_attention(q, k, v, keys, "weibull", k=2.0, dropout=0.2, chunk=4)
        results.append((out, lse, grads([q, k, v], out.sum() + lse.sum())))
    (out_e, lse_e, g_e), (out_c, lse_c, g_c) = results
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_c, lse_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_transformers_output_attentions_returns_the_maps_and_otherwise_takes_the_fused_path():
    """A caller who asks for the maps gets them (the materialized path, rows summing to one over
    the valid keys); without asking, the call is fused and returns no maps, as sdpa does."""
    from bam_pyro.transformers import to_bam

    torch.manual_seed(0)
    bam_model = to_bam(tiny_bert(), BamConfig("wc", k=10.0, beta=1e-2, d_mid=3))
    network = bam_model.network if hasattr(bam_model, "network") else bam_model
    ids, mask = torch.randint(5, 60, (2, 6)), torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    network.eval()
    maps = network(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(maps) == 1 and maps[0].shape == (2, 4, 6, 6)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 4, 6))
    assert (maps[0][1, ..., 4:] == 0).all()
    assert network(ids, attention_mask=mask).attentions is None


@pytest.mark.slow  # Inductor compiles FlexAttention's CPU kernel: about half a minute
@pytest.mark.parametrize("family", ["weibull", "lognormal"])
def test_compiled_flex_attention_adds_the_chunked_noise(family):
    """Under Inductor (the CUDA route compiles FlexAttention; CPU's compiled kernel runs inference
    without the normalizer), the score_mod's hash gives the chunked function's noise."""
    from torch.nn.attention.flex_attention import flex_attention

    from bam_pyro.fused import noise_score_mod

    q, k, v = (t.detach() for t in inputs(lq=128, lk=128))
    keys = noise.row_keys(torch.tensor(5), B, H)
    with torch.no_grad():
        out_c, _ = chunked_attention(q, k, v, keys, family, k=2.0, sigma=0.7, chunk=50)
        out_f = torch.compile(flex_attention)(q, k, v, score_mod=noise_score_mod(keys, 128, family, 2.0, 0.7), scale=1.0)
    torch.testing.assert_close(out_f, out_c, atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # Inductor compiles FlexAttention's CPU kernel: about half a minute
def test_compiled_flex_attention_takes_other_noise_constants_without_recompiling():
    """k and sigma reach the score_mod as tensors: a second model's constants reuse the compiled
    kernel. As Python floats they recompiled it with a symbolic float, which Inductor failed to lower."""
    from bam_pyro.fused import _compiled_flex_attention, noise_score_mod

    torch._dynamo.reset()
    attend = _compiled_flex_attention()
    q, k, v = (t.detach() for t in inputs(lq=32, lk=32))
    keys = noise.row_keys(torch.tensor(5), B, H)
    with torch.no_grad():
        attend(q, k, v, score_mod=noise_score_mod(keys, 32, "weibull", 2.0, 0.7), scale=1.0)
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = attend(q, k, v, score_mod=noise_score_mod(keys, 32, "weibull", 5.0, 0.7), scale=1.0)
        expected, _ = chunked_attention(q, k, v, keys, "weibull", k=5.0, chunk=10)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask_kind", ["none", "causal-padding"])
def test_chunked_attention_operators_pass_torchs_custom_op_checks(mask_kind):
    """Schema, fake (meta) kernels, strides and autograd of the two custom operators, as torch.compile
    relies on them; on transposed views, as transformers passes them."""
    from bam_pyro.fused import _chunked_attention_backward_op, _chunked_attention_op

    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in inputs(lq=9, lk=9))
    key_mask, _, causal = masks(mask_kind, 9, 9)
    keys = noise.row_keys(torch.tensor(3), B, H)
    settings = ("weibull", 2.0, 0.7, causal, 0.2, 4, False)
    torch.library.opcheck(_chunked_attention_op, (q, k, v, keys, key_mask, *settings))
    out, lse = _chunked_attention_op(q, k, v, keys, key_mask, *settings)
    grads = (torch.randn_like(out), torch.randn_like(lse))
    torch.library.opcheck(_chunked_attention_backward_op,
                          (*grads, q.detach(), k.detach(), v.detach(), lse.detach(), keys, key_mask, *settings))


def _graph_ops(fn, *args) -> set[str]:
    """The operators of the graphs Dynamo captures from ``fn(*args)``, their subgraphs included (no
    Inductor: a recording backend)."""
    ops: set[str] = set()

    def record(gm, example_inputs):
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                ops.update(str(node.target) for node in module.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record)(*args)
    torch._dynamo.reset()
    return ops


def test_compiled_calls_trace_small_maps_and_call_the_operators_on_large_ones(monkeypatch):
    """Under torch.compile a call whose map fits TRACED_ENTRIES is traced (Inductor fuses its
    element-wise chain), a larger one calls the chunked operators; eager calls always do."""
    import bam_pyro.fused as fused

    q, k, v = (t.detach() for t in inputs(lq=8, lk=8))
    keys = noise.row_keys(torch.tensor(2), B, H)

    def attend(q, k, v):
        return chunked_attention(q, k, v, keys, "weibull", k=2.0, dropout=0.1)

    traced = _graph_ops(attend, q, k, v)
    assert not any("chunked_attention" in op for op in traced) and any("softmax" in op for op in traced)
    assert any("checkpoint" in op for op in traced)  # the backward recomputes the map: none is kept
    monkeypatch.setattr(fused, "TRACED_ENTRIES", B * H * 8 * 8 - 1)
    assert any("chunked_attention" in op for op in _graph_ops(attend, q, k, v))


def test_noise_compiled_with_its_counters_is_the_eager_noise():
    """Inductor's C++ knew an arange's range and its compiler, for which int32 overflow cannot happen,
    rewrote the hash's wrapping products (other bits than eager); the counters operator hides the
    indices. Compiled by Inductor: the row keys, a chunk's noise and dropout mask, and a whole map."""
    seeds = noise.draw_seeds(torch.Size([2]))

    def draw(seeds):
        keys = noise.row_keys(seeds, B, H)
        counters = noise.counters(0, 16, seeds.device)
        return (keys, *chunk_noise(keys, counters, counters, "weibull", 2.0, 1.0, 0.3, torch.float32),
                noise.noise_map(seeds, torch.Size([B, H, 5, 7]), "lognormal", sigma=0.7))

    torch._dynamo.reset()
    compiled = torch.compile(draw)(seeds)
    torch._dynamo.reset()
    for got, expected in zip(compiled, draw(seeds)):
        torch.testing.assert_close(got, expected)


@pytest.mark.slow  # Inductor compiles forward and backward of each mask kind: about 20 s each
@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal-padding"])
def test_traced_call_under_compile_gives_the_eager_draw_and_gradients(mask_kind):
    q, k, v = inputs(lq=9, lk=9)
    key_mask, _, causal = masks(mask_kind, 9, 9)
    keys = noise.row_keys(torch.tensor(13), B, H)

    def attend(q, k, v):
        return chunked_attention(q, k, v, keys, "weibull", k=2.0, key_mask=key_mask, causal=causal, dropout=0.2)

    torch._dynamo.reset()
    results = []
    for fn in (attend, torch.compile(attend)):
        out, lse = fn(q, k, v)
        probe = torch.randn_like(out, generator=torch.Generator().manual_seed(0))
        results.append((out, lse, grads([q, k, v], (out * probe).sum() + lse.sum())))
    torch._dynamo.reset()
    (out_e, lse_e, g_e), (out_c, lse_c, g_c) = results
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_c, lse_e, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_batch_without_padding_reaches_the_attention_without_a_mask_and_draws_the_same(monkeypatch):
    """transformers' bidirectional mask is skipped when nothing is padded (sdpa's own test of the
    2D mask): the attention calls get None, mask no chunk, and give what the all-True mask gave."""
    import bam_pyro.transformers.attention as hf_attention
    from bam_pyro.transformers import to_bam
    from transformers import BertConfig, BertForSequenceClassification

    seen = []
    layout = hf_attention.fused_layout
    monkeypatch.setattr(hf_attention, "fused_layout", lambda mask, *args: seen.append(mask) or layout(mask, *args))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    network = to_bam(BertForSequenceClassification(config), BamConfig("wc", k=10.0, beta=1e-2, d_mid=3)).train()
    ids = torch.randint(5, 60, (2, 6))
    outputs = {}
    for skipped in (True, False):
        if not skipped:  # a mask function bam_mask does not know: built, all True
            monkeypatch.setattr(hf_attention, "bidirectional_mask_function", None)
        seen.clear()
        torch.manual_seed(1)
        with poutine.trace():
            outputs[skipped] = network(ids, attention_mask=torch.ones_like(ids)).logits
        outputs[skipped].sum().backward()
        assert len(seen) == 2 and all((mask is None) == skipped for mask in seen)
        outputs[skipped, "grads"] = [p.grad.clone() for p in network.parameters() if p.grad is not None]
        network.zero_grad(set_to_none=True)
    assert torch.equal(outputs[True], outputs[False])
    assert all(torch.equal(a, b) for a, b in zip(outputs[True, "grads"], outputs[False, "grads"]))


def test_transformers_reads_the_mask_once_per_forward_pass_and_again_when_it_changes(monkeypatch):
    """A host read per layer would stall a GPU at every layer: a mask that bam_pyro's mask function
    built says its layout (no read, the same outputs); any other is read once per forward pass, every
    layer sharing its layout; a mask written in place is read again; the kept layout does not keep
    the mask alive."""
    import gc
    import weakref

    import bam_pyro.transformers.attention as hf_attention
    from bam_pyro.transformers import to_bam
    from transformers import BertConfig, BertForSequenceClassification

    reads = []
    read_layout = hf_attention._read_layout
    monkeypatch.setattr(hf_attention, "_read_layout", lambda *args: reads.append(args[1:]) or read_layout(*args))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32)
    network = to_bam(BertForSequenceClassification(config), BamConfig("wc", k=10.0, beta=1e-2, d_mid=3))
    ids, mask = torch.randint(5, 60, (2, 6)), torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    outputs = []
    for kind_known in (True, False):
        if not kind_known:  # the mask of a function bam_mask does not know: its layout is read
            monkeypatch.setattr(hf_attention, "bidirectional_mask_function", None)
        torch.manual_seed(1)
        with poutine.trace():
            outputs.append(network(ids, attention_mask=mask).logits)
        assert len(reads) == (0 if kind_known else 1)
    assert torch.equal(outputs[0], outputs[1])

    padding = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    padding[1, ..., 4:] = False
    layout = hf_attention.fused_layout(padding, 6, 6, True)
    assert layout.key_mask.shape == (2, 1, 1, 6) and not layout.causal
    assert hf_attention.fused_layout(padding, 6, 6, True) is layout
    padding[0, 0, 2, 1] = False  # no longer one row for all queries: the materialized path's
    assert hf_attention.fused_layout(padding, 6, 6, True) is None
    with torch.inference_mode():  # an inference tensor has no version counter: read every time
        assert hf_attention.fused_layout(torch.ones(2, 1, 6, 6, dtype=torch.bool), 6, 6, True) is not None
    fresh = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    alive = weakref.ref(fresh)
    assert hf_attention.fused_layout(fresh, 6, 6, True) is not None
    del fresh
    gc.collect()
    assert alive() is None
