"""The translation network and its Pyro model: masks, the one attention site, its KL, draws, learning."""

import numpy as np
import pytest
import torch
from torch.distributions import kl_divergence

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.training import SVITrainer
from experiments.nmt.multi30k import BOS, EOS, make_batch
from models.decoding import greedy
from models.nmt import NetworkSizes, build_translator

VOCAB = 16
SIZES = NetworkSizes(embedding=16, encoder=12, decoder=20, attention=10, layers=2, dropout=0.1)
WC = BamConfig(variant="wc", k=5.0, beta=1e-6, d_mid=5)


@pytest.fixture(autouse=True)
def _one_thread():
    """Small recurrent steps are several times faster on one thread (and share the machine)."""
    torch.set_num_threads(1)


def translator(config=WC, sizes=SIZES):
    torch.manual_seed(0)
    return build_translator(VOCAB, sizes, config, ObjectiveConfig(reduction="sum")).eval()


def sentences(*lengths):
    """Pairs of random pieces with the given (source, target) lengths."""
    g = torch.Generator().manual_seed(1)
    return ([torch.randint(4, VOCAB, (s,), generator=g).numpy() for s, _ in lengths],
            [torch.randint(4, VOCAB, (t,), generator=g).numpy() for _, t in lengths])


def traced_site(model, batch):
    """The attention site of one guided pass: (KL summed over its entries, model site, guide site)."""
    guide = AttentionGuide(model.model)
    args, kwargs = batch.model_args
    guide(*args, **kwargs)
    model_trace, guide_trace = guide.get_traces()
    latent = [n for n, s in model_trace.nodes.items() if s["type"] == "sample" and not s["is_observed"]]
    assert latent == ["attention"]
    prior, posterior = model_trace.nodes["attention"], guide_trace.nodes["attention"]
    return kl_divergence(posterior["fn"], prior["fn"]), prior, posterior


def test_one_site_covers_all_steps_and_padding_has_zero_weight_and_zero_kl():
    model = translator()
    model.record_attention = True
    sources, targets = sentences((3, 2), (6, 5))
    batch = make_batch(sources, targets)
    kl, prior, _ = traced_site(model, batch)
    # targets are framed with BOS / EOS: 3 and 6 steps
    assert prior["fn"].event_shape == (2, 1, 6, 6) and prior["fn"].batch_shape == ()
    normalized = model_trace_weights(model, batch)
    assert torch.all(normalized[0, :, :, 3:] == 0)  # padded sources of sentence 0
    assert torch.allclose(normalized[1].sum(-1), torch.ones(1, 6))
    assert torch.allclose(normalized[0, :, :3].sum(-1), torch.ones(1, 3))
    # the KL of the padded batch is the KL of each sentence alone: padded entries add nothing
    alone = [traced_site(model, make_batch([s], [t]))[0] for s, t in zip(sources, targets)]
    assert kl.item() == pytest.approx(sum(a.item() for a in alone), rel=1e-5)


def model_trace_weights(model, batch):
    guide = AttentionGuide(model.model)
    args, kwargs = batch.model_args
    guide(*args, **kwargs)
    return guide.get_traces()[0].nodes["attention.weights"]["value"]


@pytest.mark.parametrize("scope", ["query_keys", "all_keys"])
def test_contextual_prior_is_one_distribution_per_sentence_shared_by_all_target_steps(scope):
    model = translator(WC.replace(prior_scope=scope))
    batch = make_batch(*sentences((3, 4), (6, 2)))
    _, prior, _ = traced_site(model, batch)
    psi = prior["fn"].base_dist.concentration / prior["fn"].base_dist.rate  # alpha = Psi * beta
    assert torch.allclose(psi[0, 0], psi[0, 0, :1].expand(5, 6))  # the same for every target step
    assert torch.allclose(psi[:, 0, 0].masked_fill(~batch.src_mask, 0).sum(-1), torch.ones(2), atol=1e-5)
    assert torch.all(psi[0, 0, 0, 3:] <= 1e-19)  # padded keys get no prior mass (the log floor)


def test_eval_mode_attention_is_the_soft_attention_of_the_loop():
    model = translator()
    network = model.network
    batch = make_batch(*sentences((3, 4), (6, 2)))
    memory = network.encode(batch.src, batch.src_mask)
    outputs = network.decoder_states(memory, batch.tgt_in)
    weights = network.attention_weights(outputs.scores, memory, batch.tgt_mask)
    soft = outputs.scores.masked_fill(~batch.src_mask[:, None], -1e30).softmax(-1)
    assert torch.allclose(weights, soft, atol=1e-6)
    assert torch.allclose(network.context(weights, memory), outputs.contexts, atol=1e-6)
    logits = network.generate(outputs.states, outputs.contexts)
    assert torch.allclose(model.log_probs(*batch.inputs), logits.log_softmax(-1), atol=1e-5)


def test_stepwise_decoding_matches_the_teacher_forced_pass():
    model = translator()
    network = model.network
    batch = make_batch(*sentences((3, 4), (6, 2)))
    memory = network.encode(batch.src, batch.src_mask)
    forced = network.decoder_states(memory, batch.tgt_in)
    state = network.initial_state(memory)
    for j in range(batch.tgt_in.size(1)):
        step, state = network.step(memory, state, batch.tgt_in[:, j])
        for one, all_steps in zip(step, forced):
            assert torch.allclose(one, all_steps[:, j], atol=1e-6)


def test_padding_does_not_change_a_sentence_log_probs():
    model = translator()
    sources, targets = sentences((3, 2), (7, 6))
    together = model.log_probs(*make_batch(sources, targets).inputs)
    alone = model.log_probs(*make_batch(sources[:1], targets[:1]).inputs)
    assert torch.allclose(together[0, :3], alone[0], atol=1e-5)


def test_generate_broadcasts_over_alignments():
    """Hard attention reads the output of every source position as the context: [B, T, S, V]."""
    network = translator().network
    batch = make_batch(*sentences((3, 4), (5, 2)))
    memory = network.encode(batch.src, batch.src_mask)
    states = network.decoder_states(memory, batch.tgt_in).states
    every = network.generate(states[:, :, None], memory.states[:, None])
    assert every.shape == (2, 5, 5, VOCAB)
    one = network.generate(states, memory.states[:, 2:3].expand(-1, 5, -1))
    assert torch.allclose(every[:, :, 2], one, atol=1e-6)


def test_vectorized_posterior_draws_vary_and_respect_padding():
    from experiments.nmt.attention import SITE, as_sentences, posterior_chains

    model = translator()
    batch = make_batch(*sentences((3, 4), (6, 2)))
    (posterior,), (prior,) = posterior_chains(model, batch, draws=30, seed=0, chains=1)
    posterior, prior = as_sentences(posterior[SITE], batch), as_sentences(prior[SITE], batch)[0]
    assert posterior.shape == (30, 2, 5, 6) and prior.shape == (2, 5, 6)
    valid = ~np.isnan(posterior[0])
    assert valid.sum() == 3 * 5 + 6 * 3
    np.testing.assert_allclose(np.nansum(posterior, -1)[:, 0], 1.0, rtol=1e-5)
    assert posterior[:, valid].std(0).min() > 0  # every valid entry varies over the draws
    np.testing.assert_allclose(np.nansum(prior, -1)[1, :3], 1.0, rtol=1e-5)


def test_empty_source_sentence_is_refused():
    network = translator().network
    src = torch.tensor([[5, 6], [0, 0]])
    with pytest.raises(ValueError, match=r"empty source sentence in the batch \(rows \[1\]\)"):
        network.encode(src, src != 0)


def test_a_small_model_learns_to_reverse_sequences():
    """BAM-WC trained by SVI learns to reverse random sequences (impossible without attending):
    greedy decoding is then exact for most held-out sequences (chance: about 10^-4)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    def sample(n):
        sources = [rng.integers(4, VOCAB, size=rng.integers(3, 7)) for _ in range(n)]
        return sources, [s[::-1].copy() for s in sources]

    sizes = NetworkSizes(embedding=32, encoder=32, decoder=32, attention=32, layers=1, dropout=0.0)
    model = build_translator(VOCAB, sizes, WC, ObjectiveConfig(anneal_rate=1.0))
    trainer = SVITrainer(model, AttentionGuide(model.model), torch.optim.Adam(model.parameters(), lr=1e-2))
    for _ in range(160):
        args, kwargs = make_batch(*sample(32)).model_args
        trainer.step(*args, **kwargs)
    sources, targets = sample(100)
    test = make_batch(sources, targets)
    outputs = greedy(model, test.src, test.src_mask, BOS, EOS)
    exact = np.mean([out == target.tolist() for out, target in zip(outputs, targets)])
    assert exact > 0.6


def test_log_softmax_categorical_is_pyros_categorical():
    from pyro.distributions import Categorical

    from models.nmt import LogSoftmaxCategorical

    logits, tokens = 5 * torch.randn(3, 4, 9), torch.randint(0, 9, (3, 4))
    ours, pyros = LogSoftmaxCategorical(logits), Categorical(logits=logits)
    assert torch.allclose(ours.log_prob(tokens), pyros.log_prob(tokens), atol=1e-6)
    assert torch.allclose(ours.probs, pyros.probs, atol=1e-6)
    wider = ours.expand((2, 3, 4))
    assert isinstance(wider, LogSoftmaxCategorical) and wider.log_prob(tokens).shape == (2, 3, 4)
