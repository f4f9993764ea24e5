"""The latent-alignment family of Deng et al. (2018): each loss against its closed form computed by
hand from the network's own outputs, the score-function surrogate's value and gradient against
their formulas, padding, prediction (exact and top-K), and a toy copy task every variant learns.

The network is a stand-in for ``models.nmt.Seq2Seq`` with the interface of
:class:`bam_pyro.alignment.AlignmentNetwork`: a bi-LSTM encoder, an input-feeding LSTM decoder
with MLP attention and the output layer ``W tanh(L_h h + L_c c)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
import pyro.optim
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceEnum_ELBO, TraceGraph_ELBO
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from bam_pyro import ObjectiveConfig
from guides.alignment import InferenceNetwork
from bam_pyro.alignment import (
    ALIGNMENT,
    ALIGNMENT_VARIANTS,
    AlignmentELBO,
    MaskedDirichlet,
    PriorGuide,
    VariationalAlignmentGuide,
    guide_for,
    AlignmentConfig,
    LatentAlignmentModel,
    elbo_for,
    teacher_forced_perplexity,
)

BOS, EOS = 1, 2


@pytest.fixture(autouse=True)
def _one_thread():
    """Tensors here are tiny: a second intra-op thread only adds synchronization (on a loaded
    machine, several times the run time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Memory(NamedTuple):
    states: Tensor
    mask: Tensor


class Steps(NamedTuple):
    states: Tensor
    scores: Tensor


class TinySeq2Seq(nn.Module):
    """Stand-in translation network (see module doc). ``padding_noise``: fill the encoder states of
    padded sources with random values, so that any weight they receive shows in the loss."""

    def __init__(self, vocab_size: int, size: int = 12, padding_noise: bool = False) -> None:
        super().__init__()
        self.vocab_size, self.padding_noise = vocab_size, padding_noise
        self.source_embedding = nn.Embedding(vocab_size, size)
        self.target_embedding = nn.Embedding(vocab_size, size)
        self.encoder = nn.LSTM(size, size, batch_first=True, bidirectional=True)
        self.decoder = nn.LSTMCell(3 * size, size)
        self.score_query, self.score_key = nn.Linear(size, size), nn.Linear(2 * size, size, bias=False)
        self.score_out = nn.Linear(size, 1, bias=False)
        self.output_state, self.output_context = nn.Linear(size, size), nn.Linear(2 * size, size, bias=False)
        self.output = nn.Linear(size, vocab_size)

    def encode(self, src: Tensor, src_mask: Tensor) -> Memory:
        packed = pack_padded_sequence(self.source_embedding(src), src_mask.sum(-1), batch_first=True,
                                      enforce_sorted=False)
        states = pad_packed_sequence(self.encoder(packed)[0], batch_first=True, total_length=src.size(1))[0]
        if self.padding_noise:
            states = torch.where(src_mask.unsqueeze(-1), states, 10 * torch.randn_like(states))
        return Memory(states, src_mask)

    def decoder_states(self, memory: Memory, tgt_in: Tensor) -> Steps:
        batch, size = tgt_in.size(0), self.decoder.hidden_size
        h, c = memory.states.new_zeros(batch, size), memory.states.new_zeros(batch, size)
        feed = memory.states.new_zeros(batch, memory.states.size(-1))
        keys, states, scores = self.score_key(memory.states), [], []
        for j in range(tgt_in.size(1)):
            h, c = self.decoder(torch.cat([self.target_embedding(tgt_in[:, j]), feed], -1), (h, c))
            score = self.score_out(torch.tanh(keys + self.score_query(h).unsqueeze(1))).squeeze(-1)
            soft = score.masked_fill(~memory.mask, -1e9).softmax(-1)
            feed = torch.bmm(soft.unsqueeze(1), memory.states).squeeze(1)
            states.append(h)
            scores.append(score)
        return Steps(torch.stack(states, 1), torch.stack(scores, 1))

    def generate(self, states: Tensor, contexts: Tensor) -> Tensor:
        return self.output(torch.tanh(self.output_state(states) + self.output_context(contexts)))


def build(variant: str, vocab: int = 9, objective: ObjectiveConfig = ObjectiveConfig(), padding_noise: bool = False,
          **config) -> LatentAlignmentModel:
    network = TinySeq2Seq(vocab, padding_noise=padding_noise)
    inference = None
    if ALIGNMENT_VARIANTS[variant].guide == "inference":
        inference = InferenceNetwork(network.source_embedding, network.target_embedding, hidden=10, layers=2)
    return LatentAlignmentModel(network, objective, AlignmentConfig(variant, **config), inference)


def toy_batch(batch: int = 4, vocab: int = 9, seed: int = 0):
    """Sources of 3 to 5 tokens (padded), targets = source + EOS (copy), teacher-forcing inputs BOS + source."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 6, (batch,), generator=g)
    lengths[0] = 5
    src = torch.randint(3, vocab, (batch, 5), generator=g)
    src_mask = torch.arange(5) < lengths.unsqueeze(-1)
    src = src.masked_fill(~src_mask, 0)
    tgt_out = torch.cat([src, torch.zeros(batch, 1, dtype=torch.long)], -1)
    tgt_out[torch.arange(batch), lengths] = EOS
    tgt_mask = torch.arange(6) <= lengths.unsqueeze(-1)
    tgt_in = torch.cat([torch.full((batch, 1), BOS), tgt_out[:, :-1]], -1).masked_fill(~tgt_mask, 0)
    return src, src_mask, tgt_in, tgt_mask, tgt_out


def network_tables(model: LatentAlignmentModel, src, src_mask, tgt_in, tgt_out):
    """By hand from the network: log p(z_j = i) ``[B, T, S]`` and log p(y_j | z_j = i) ``[B, T, S]``."""
    network = model.network
    memory = network.encode(src, src_mask)
    steps = network.decoder_states(memory, tgt_in)
    log_prior = steps.scores.masked_fill(~src_mask.unsqueeze(1), -math.inf).log_softmax(-1)
    logits = network.generate(steps.states.unsqueeze(2), memory.states.unsqueeze(1))  # [B, T, S, V]
    index = tgt_out[:, :, None, None].expand(*logits.shape[:3], 1)
    log_lik = logits.log_softmax(-1).gather(-1, index).squeeze(-1)
    return log_prior, log_lik, memory, steps


def token_mean(values: Tensor, tgt_mask: Tensor) -> Tensor:
    return values[tgt_mask].sum() / tgt_mask.sum()


# --- losses against their closed forms ---------------------------------------------------------


@pytest.mark.parametrize("max_logit_elements", [2**24, 40])
def test_enumerated_marginal_equals_hand_logsumexp(max_logit_elements):
    """``exact``: TraceEnum_ELBO's loss is the mean of -log sum_i p(z=i) p(y | i) over target tokens,
    whether the output layer runs at once or in checkpointed chunks, with the same gradient."""
    model = build("exact", max_logit_elements=max_logit_elements)
    batch = toy_batch()
    loss = elbo_for("exact").differentiable_loss(model.model, guide_for(model), *batch)
    log_prior, log_lik, _, _ = network_tables(model, *batch[:3], batch[4])
    expected = -token_mean(torch.logsumexp(log_prior + log_lik, -1), batch[3])
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    params = [p for p in model.parameters()]
    for got, want in zip(torch.autograd.grad(loss, params, allow_unused=True),
                         torch.autograd.grad(expected, params, allow_unused=True)):
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def variational_closed_form(model, batch, kl_weight):
    """-mean_j [sum_i q_ji log p(y_j | i) - kl_weight * KL(q_j || p_j)] with q from the inference network."""
    src, src_mask, tgt_in, tgt_mask, tgt_out = batch
    log_prior, log_lik, _, _ = network_tables(model, src, src_mask, tgt_in, tgt_out)
    scores = model.inference(src, src_mask, tgt_out, tgt_mask)
    log_q = scores.masked_fill(~src_mask.unsqueeze(1), -math.inf).log_softmax(-1)
    q = log_q.exp()
    kl = torch.where(q > 0, q * (log_q - log_prior), 0.0).sum(-1)
    return -token_mean((q * log_lik).sum(-1) - kl_weight * kl, tgt_mask)


def test_guide_enumerated_elbo_equals_closed_form():
    """``va-enum``: TraceEnum_ELBO with q enumerated in the guide is exactly E_q[log p(y|z)] - lambda KL,
    lambda = kl_weight * sigmoid(t * rho); AlignmentELBO gives the same value and gradient."""
    objective = ObjectiveConfig(kl_weight=0.5, anneal_rate=0.3)
    model = build("va-enum", objective=objective)
    batch = toy_batch()
    kl_weight = 0.5 / (1 + math.exp(-4 * 0.3))
    expected = variational_closed_form(model, batch, kl_weight)
    guide = guide_for(model)
    loss = TraceEnum_ELBO(max_plate_nesting=2).differentiable_loss(model.model, guide, *batch, step=4)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    ours = AlignmentELBO().differentiable_loss(model.model, guide, *batch, step=4)
    assert ours.item() == pytest.approx(expected.item(), abs=1e-5)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(loss, params, allow_unused=True),
                    torch.autograd.grad(ours, params, allow_unused=True)):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_hard_enum_is_the_jensen_bound():
    """``hard-enum``: q = p, enumerated: the loss is -mean_j sum_i p_ji log p(y_j | i), no KL."""
    model = build("hard-enum")
    batch = toy_batch()
    loss = elbo_for("hard-enum").differentiable_loss(model.model, guide_for(model), *batch)
    log_prior, log_lik, _, _ = network_tables(model, *batch[:3], batch[4])
    expected = -token_mean((log_prior.exp() * log_lik).sum(-1), batch[3])
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_relaxed_loss_takes_the_analytic_dirichlet_kl():
    """``va-relaxed``: TraceMeanField_ELBO's loss is -mean_j [log p(y_j | z_j) - lambda KL(q_j || p_j)]
    at the guide's draw z_j, the KL in closed form (a Monte Carlo fallback would differ)."""
    model = build("va-relaxed", objective=ObjectiveConfig(kl_weight=0.7))
    src, src_mask, tgt_in, tgt_mask, tgt_out = batch = toy_batch()
    guide = guide_for(model)
    pyro.set_rng_seed(5)
    loss = elbo_for("va-relaxed").differentiable_loss(model.model, guide, *batch)
    pyro.set_rng_seed(5)
    guide_trace = poutine.trace(guide).get_trace(*batch)
    z = guide_trace.nodes[ALIGNMENT]["value"]
    q = guide_trace.nodes[ALIGNMENT]["fn"]
    assert torch.all(z[~src_mask.unsqueeze(1).expand_as(z)] == 0)
    memory = model.network.encode(src, src_mask)
    steps = model.network.decoder_states(memory, tgt_in)
    log_lik = model.network.generate(steps.states, z @ memory.states).log_softmax(-1)
    log_lik = log_lik.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)
    prior_alpha = steps.scores.exp().clamp(1e-2, 1e4)
    kl = torch.zeros_like(log_lik)
    for b in range(src.size(0)):
        n = int(src_mask[b].sum())
        kl[b] = torch.distributions.kl_divergence(torch.distributions.Dirichlet(q.concentration[b, :, :n]),
                                                  torch.distributions.Dirichlet(prior_alpha[b, :, :n]))
    expected = -token_mean(log_lik - 0.7 * kl, tgt_mask)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)


def test_relaxed_warm_start_is_the_jensen_bound_then_the_variational_guide():
    """Deng et al.'s Algorithm 2: while warming, the loss is -mean_j log p(y_j | z_j) at a draw z_j of
    the model's own Dirichlet (no KL, no gradient to the inference network); from step ``warm_steps``
    on, q is the inference network's and the KL is back."""
    model = build("va-relaxed", objective=ObjectiveConfig(kl_weight=0.7))
    src, src_mask, tgt_in, tgt_mask, tgt_out = batch = toy_batch()
    guide, elbo = guide_for(model, warm_steps=2), elbo_for("va-relaxed")
    loss = elbo.differentiable_loss(model.model, guide, *batch, step=1)
    _, guide_trace = guide.get_traces()
    z = guide_trace.nodes[ALIGNMENT]["value"]
    memory = model.network.encode(src, src_mask)
    steps = model.network.decoder_states(memory, tgt_in)
    prior_alpha = steps.scores.exp().clamp(1e-2, 1e4)
    valid = src_mask.unsqueeze(1).expand_as(prior_alpha)
    torch.testing.assert_close(guide_trace.nodes[ALIGNMENT]["fn"].concentration[valid], prior_alpha[valid])
    log_lik = model.network.generate(steps.states, z @ memory.states).log_softmax(-1)
    expected = -token_mean(log_lik.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1), tgt_mask)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)
    shared = {id(p) for p in model.network.parameters()}  # the word embeddings
    inference = [p for p in model.inference.parameters() if id(p) not in shared]
    grads = torch.autograd.grad(loss, inference, allow_unused=True)
    assert all(g is None or torch.all(g == 0) for g in grads)

    assert guide.warming(1) and not guide.warming(2)
    pyro.set_rng_seed(5)
    loss = elbo.differentiable_loss(model.model, guide, *batch, step=2)
    pyro.set_rng_seed(5)
    assert loss.item() == pytest.approx(elbo.differentiable_loss(model.model, guide_for(model), *batch).item())
    assert any(g is not None and torch.any(g != 0) for g in torch.autograd.grad(loss, inference, allow_unused=True))


def test_only_the_relaxed_variant_takes_a_warm_start():
    with pytest.raises(ValueError, match="va-relaxed"):
        guide_for(build("va-sample"), warm_steps=3)


def test_masked_dirichlet_matches_torch_on_the_valid_entries():
    alpha = torch.rand(3, 5) * 3 + 0.1
    beta = torch.rand(3, 5) * 3 + 0.1
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    q, p = MaskedDirichlet(alpha, mask), MaskedDirichlet(beta, mask)
    value = q.rsample()
    assert torch.all(value[~mask] == 0) and torch.allclose(value.sum(-1), torch.ones(3))
    kl = torch.distributions.kl_divergence(q, p)
    for b in range(3):
        n = int(mask[b].sum())
        full_q, full_p = torch.distributions.Dirichlet(alpha[b, :n]), torch.distributions.Dirichlet(beta[b, :n])
        assert kl[b].item() == pytest.approx(torch.distributions.kl_divergence(full_q, full_p).item(), rel=1e-5)
        assert q.log_prob(value)[b].item() == pytest.approx(full_q.log_prob(value[b, :n]).item(), rel=1e-5)


# --- the score-function surrogate against a hand computation -----------------------------------


class ToyAlignment:
    """A tiny model with one sampled alignment per token: p(z) = softmax(psi), p(y | z) = softmax(W[z]),
    a fixed baseline; q(z) = softmax(phi) or, with ``hard``, the prior itself (PriorGuide)."""

    def __init__(self, kl_weight: float) -> None:
        g = torch.Generator().manual_seed(1)
        self.B, self.T, self.S, self.V = 2, 3, 4, 5
        self.psi = torch.randn(self.B, self.T, self.S, generator=g).requires_grad_()
        self.phi = torch.randn(self.B, self.T, self.S, generator=g).requires_grad_()
        self.W = torch.randn(self.S, self.B, self.T, self.V, generator=g).requires_grad_()
        self.y = torch.randint(0, self.V, (self.B, self.T), generator=g)
        self.baseline = torch.randn(self.B, self.T, generator=g) - 1.5
        self.mask = torch.tensor([[True, True, False], [True, True, True]])
        self.scale, self.kl_weight = 1.0 / 5, kl_weight
        self.draws: list[Tensor] = []

    def plates(self):
        return (pyro.plate("b", self.B, dim=-2), pyro.plate("t", self.T, dim=-1), poutine.mask(mask=self.mask),
                poutine.scale(scale=self.scale))

    def model(self) -> None:
        b, t, mask, scale = self.plates()
        with b, t, mask, scale:
            with poutine.scale(scale=self.kl_weight):
                z = pyro.sample("z", dist.Categorical(logits=self.psi))
            self.draws.append(z)
            logits = self.W[z, torch.arange(self.B)[:, None], torch.arange(self.T)]
            pyro.sample("y", dist.Categorical(logits=logits), obs=self.y,
                        infer={"baseline": {"baseline_value": self.baseline}})

    def guide(self) -> None:
        b, t, mask, scale = self.plates()
        with b, t, mask, scale, poutine.scale(scale=self.kl_weight):
            pyro.sample("z", dist.Categorical(logits=self.phi))


def test_surrogate_value_and_gradient_equal_the_papers_estimator():
    """Value: -sum_j w_j [log f_j(z_j) - lambda KL_j]. Gradients (w_j = mask / N):
    d/dphi_i = -w [(log f - B)(1[i = z] - q_i) - lambda q_i (log q_i - log p_i - KL)],
    d/dpsi_i = w lambda (p_i - q_i), d/dW[z, v] = -w (1[v = y] - softmax(W[z])_v)."""
    toy = ToyAlignment(kl_weight=0.6)
    loss = AlignmentELBO().differentiable_loss(toy.model, toy.guide)
    z = toy.draws[-1]
    w = toy.mask * toy.scale
    log_f_all = toy.W.log_softmax(-1)  # [S, B, T, V]
    rows, cols = torch.arange(toy.B)[:, None], torch.arange(toy.T)
    log_f = log_f_all[z, rows, cols, toy.y].detach()
    log_q, log_p = toy.phi.log_softmax(-1).detach(), toy.psi.log_softmax(-1).detach()
    q, p = log_q.exp(), log_p.exp()
    kl = (q * (log_q - log_p)).sum(-1)
    assert loss.item() == pytest.approx(-(w * (log_f - 0.6 * kl)).sum().item(), abs=1e-6)

    grad_phi, grad_psi, grad_w = torch.autograd.grad(loss, [toy.phi, toy.psi, toy.W])
    onehot = torch.nn.functional.one_hot(z, toy.S).float()
    reward = (log_f - toy.baseline).unsqueeze(-1)
    want_phi = -w.unsqueeze(-1) * (reward * (onehot - q) - 0.6 * q * (log_q - log_p - kl.unsqueeze(-1)))
    torch.testing.assert_close(grad_phi, want_phi, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_psi, 0.6 * w.unsqueeze(-1) * (p - q), atol=1e-6, rtol=1e-5)
    want_w = torch.zeros_like(toy.W)
    softmax_z = log_f_all[z, rows, cols].exp().detach()
    want_w[z, rows, cols] = -w.unsqueeze(-1) * (torch.nn.functional.one_hot(toy.y, toy.V) - softmax_z)
    torch.testing.assert_close(grad_w, want_w, atol=1e-6, rtol=1e-5)


def test_hard_surrogate_is_reinforce_on_the_prior():
    """q = p (PriorGuide): no KL; value -sum_j w_j log f_j(z_j), d/dpsi_i = -w (log f - B)(1[i = z] - p_i)."""
    toy = ToyAlignment(kl_weight=1.0)
    loss = AlignmentELBO().differentiable_loss(toy.model, PriorGuide(toy.model))
    z = toy.draws[-1]
    w = toy.mask * toy.scale
    log_f = toy.W.log_softmax(-1)[z, torch.arange(toy.B)[:, None], torch.arange(toy.T), toy.y].detach()
    assert loss.item() == pytest.approx(-(w * log_f).sum().item(), abs=1e-6)
    (grad_psi,) = torch.autograd.grad(loss, [toy.psi])
    p = toy.psi.softmax(-1).detach()
    want = -w.unsqueeze(-1) * (log_f - toy.baseline).unsqueeze(-1) * (torch.nn.functional.one_hot(z, toy.S) - p)
    torch.testing.assert_close(grad_psi, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", ["hard", "va-sample"])
def test_sampled_variants_use_the_soft_likelihood_as_baseline(variant):
    """The model attaches log p(y_j | x, E_p[z_j]) (soft attention) to its observed site."""
    model = build(variant)
    src, src_mask, tgt_in, tgt_mask, tgt_out = batch = toy_batch()
    trace = poutine.trace(model.model).get_trace(*batch)
    baseline = trace.nodes["y"]["infer"]["baseline"]["baseline_value"]
    log_prior, log_lik, memory, steps = network_tables(model, src, src_mask, tgt_in, tgt_out)
    soft = model.network.generate(steps.states, log_prior.exp() @ memory.states).log_softmax(-1)
    torch.testing.assert_close(baseline, soft.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1))


# --- padding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(ALIGNMENT_VARIANTS))
def test_padded_sources_get_zero_probability_and_no_influence(variant):
    """p, q and the draws put no mass on padded sources, and the loss does not change when their
    encoder states do (the stand-in fills them with fresh noise on every pass)."""
    model = build(variant, padding_noise=True)
    src, src_mask, tgt_in, tgt_mask, tgt_out = batch = toy_batch()
    assert not src_mask.all()
    guide, elbo = guide_for(model), elbo_for(variant)
    losses = []
    for _ in range(2):
        pyro.set_rng_seed(3)
        losses.append(elbo.differentiable_loss(model.model, guide, *batch).item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    padded = ~src_mask.unsqueeze(1).expand(-1, tgt_in.size(1), -1)
    trace = poutine.trace(model.model).get_trace(*batch)
    fn = trace.nodes[ALIGNMENT]["fn"]
    weights = fn.mean if ALIGNMENT_VARIANTS[variant].relaxed else fn.probs
    assert torch.all(weights[padded] == 0)
    if ALIGNMENT_VARIANTS[variant].guide == "inference":
        q = poutine.trace(guide).get_trace(*batch).nodes[ALIGNMENT]["fn"]
        assert torch.all((q.mean if ALIGNMENT_VARIANTS[variant].relaxed else q.probs)[padded] == 0)


@pytest.mark.parametrize("variant", ["va-sample", "va-relaxed"])
def test_predictive_draws_posterior_alignments_and_prior_targets(variant):
    """``Predictive`` over model and guide, vectorized over draws: alignments from q on the valid
    sources only; the model alone samples target tokens (its prior predictive)."""
    model = build(variant)
    src, src_mask, tgt_in, tgt_mask, tgt_out = batch = toy_batch()
    draws = Predictive(model.model, guide=guide_for(model), num_samples=3, parallel=True,
                       return_sites=[ALIGNMENT])(*batch)[ALIGNMENT]
    lengths = src_mask.sum(-1)[None, :, None]
    if ALIGNMENT_VARIANTS[variant].relaxed:
        assert draws.shape == (3, *tgt_mask.shape, src.size(1))
        torch.testing.assert_close(draws.sum(-1), torch.ones(draws.shape[:-1]))
        assert torch.all(draws[(torch.arange(src.size(1)) >= lengths[..., None]).expand_as(draws)] == 0)
    else:
        assert draws.shape == (3, *tgt_mask.shape) and torch.all(draws < lengths)
    targets = Predictive(model.model, num_samples=2, return_sites=["y"])(src, src_mask, tgt_in, tgt_mask)["y"]
    assert targets.shape == (2, *tgt_mask.shape) and targets.min() >= 0 and targets.max() < model.network.vocab_size


# --- prediction ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_logit_elements", [2**24, 50])
def test_prediction_marginalizes_exactly_or_over_the_top_k(max_logit_elements):
    """log_probs = log sum_i p_i softmax(generate(h_j, x_i)) over valid i; top-K with K >= S is the same;
    K = 1 is the most probable alignment's distribution; one decoding step matches its row."""
    model = build("va-enum", max_logit_elements=max_logit_elements).eval()
    src, src_mask, tgt_in, tgt_mask, tgt_out = toy_batch()
    with torch.no_grad():
        memory = model.network.encode(src, src_mask)
        steps = model.network.decoder_states(memory, tgt_in)
        log_prior = steps.scores.masked_fill(~src_mask.unsqueeze(1), -math.inf).log_softmax(-1)
        all_logits = model.network.generate(steps.states.unsqueeze(2), memory.states.unsqueeze(1))
        exact = torch.logsumexp(log_prior.unsqueeze(-1) + all_logits.log_softmax(-1), dim=2)
        torch.testing.assert_close(model.log_probs(src, src_mask, tgt_in, tgt_mask), exact)
        model.top_k = 5
        torch.testing.assert_close(model.log_probs(src, src_mask, tgt_in, tgt_mask), exact)
        model.top_k = 1
        best = log_prior.argmax(-1)
        expected = all_logits.log_softmax(-1).gather(2, best[:, :, None, None].expand(-1, -1, 1, model.network.vocab_size))
        torch.testing.assert_close(model.log_probs(src, src_mask, tgt_in, tgt_mask), expected.squeeze(2))
        model.top_k = None
        step = Steps(steps.states[:, 2], steps.scores[:, 2])
        torch.testing.assert_close(model.next_token_log_probs(memory, step), exact[:, 2])


def test_perplexity_of_exact_is_the_exponentiated_loss():
    """The exact model's loss is the mean negative log marginal: exp(loss) is its perplexity."""
    model = build("exact").eval()
    batch = toy_batch()
    loss = elbo_for("exact").differentiable_loss(model.model, guide_for(model), *batch)
    assert teacher_forced_perplexity(model, [batch]) == pytest.approx(math.exp(loss.item()), rel=1e-5)


def test_relaxed_prediction_is_a_normalized_distribution():
    model = build("va-relaxed").eval()
    src, src_mask, tgt_in, tgt_mask, _ = toy_batch()
    with torch.no_grad():
        log_probs = model.log_probs(src, src_mask, tgt_in, tgt_mask)
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(log_probs.shape[:-1]))


# --- learning -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(ALIGNMENT_VARIANTS))
def test_each_variant_learns_a_toy_copy_task(variant):
    """40 steps of the copy task, a fresh batch each step: on held-out sentences the predicted next
    token (alignment marginalized) is right on more than 55% of the targets. The same decoder with the
    source hidden (encoder states zeroed) stays near 30% (the EOS and some frequent tokens); copying
    needs the alignment to find the source position."""
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    model = build(variant, vocab=9)
    guide, elbo = guide_for(model), elbo_for(variant)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with pyro.validation_enabled(False):
        for step in range(40):
            loss = elbo.differentiable_loss(model.model, guide, *toy_batch(batch=32, seed=10 + step), step=step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    src, src_mask, tgt_in, tgt_mask, tgt_out = toy_batch(batch=64, seed=999)
    with torch.no_grad():
        predicted = model.eval().log_probs(src, src_mask, tgt_in, tgt_mask).argmax(-1)
    accuracy = (predicted == tgt_out)[tgt_mask].float().mean().item()
    assert accuracy > 0.55, f"{variant}: held-out accuracy {accuracy:.2f}"


@pytest.mark.parametrize("variant", sorted(ALIGNMENT_VARIANTS))
def test_pyro_svi_with_pyro_optim_takes_the_same_step_as_the_torch_path(variant):
    """``SVI(model.model, guide, pyro.optim.Adam, loss=elbo_for(variant))``, the Pyro user's call:
    the same loss and the same parameter update as Adam on ``differentiable_loss`` (the trainer's)."""
    batch = toy_batch()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build(variant))
    by_svi, by_torch = models
    pyro.clear_param_store()
    pyro.set_rng_seed(1)
    svi = SVI(by_svi.model, guide_for(by_svi), pyro.optim.Adam({"lr": 0.01}), loss=elbo_for(variant))
    svi_loss = svi.step(*batch)
    pyro.set_rng_seed(1)
    loss = elbo_for(variant).differentiable_loss(by_torch.model, guide_for(by_torch), *batch)
    optimizer = torch.optim.Adam(by_torch.parameters(), lr=0.01)
    loss.backward()
    optimizer.step()
    assert svi_loss == pytest.approx(loss.item(), rel=1e-6)
    for (name, trained), expected in zip(by_svi.named_parameters(), by_torch.parameters()):
        torch.testing.assert_close(trained, expected, msg=name)
    assert not torch.equal(by_svi.network.output.weight, build(variant).network.output.weight)  # it moved
    pyro.clear_param_store()


def test_exact_refuses_an_elbo_or_predictive_that_does_not_enumerate():
    """With ``exact``'s empty guide, ``Trace_ELBO`` samples the alignment from the prior (Pyro only
    warns) and ``Predictive`` returns prior draws as a posterior: both raise; enumeration runs."""
    model, batch = build("exact"), toy_batch()
    for loss in (Trace_ELBO(max_plate_nesting=2), TraceGraph_ELBO(max_plate_nesting=2)):
        with pytest.raises(ValueError, match="summed out by enumeration: train it with TraceEnum_ELBO"):
            loss.loss(model.model, guide_for(model), *batch)
    with pytest.raises(ValueError, match="posterior draws call model.posterior_alignments, for prior draws Predictive"):
        Predictive(model.model, guide=guide_for(model), num_samples=2)(*batch)
    assert math.isfinite(elbo_for("exact").loss(model.model, guide_for(model), *batch))
    prior = Predictive(model.model, num_samples=2, return_sites=[ALIGNMENT])(*batch)[ALIGNMENT]
    assert prior.shape == (2, *batch[3].shape)


# --- bad input ----------------------------------------------------------------------------------


def test_bad_input_errors_clearly():
    with pytest.raises(ValueError, match="unknown latent-alignment variant 'soft-ish'"):
        AlignmentConfig("soft-ish")
    with pytest.raises(ValueError, match="unknown latent-alignment variant"):
        elbo_for("bam")
    with pytest.raises(ValueError, match="top_k must be None or a whole number >= 1"):
        AlignmentConfig("exact", top_k=0)
    network = TinySeq2Seq(9)
    with pytest.raises(ValueError, match="needs an inference network"):
        LatentAlignmentModel(network, ObjectiveConfig(), AlignmentConfig("va-sample"))
    with pytest.raises(ValueError, match="layers must be a whole number >= 1"):
        InferenceNetwork(network.source_embedding, network.target_embedding, 4, layers=0)
    with pytest.raises(ValueError, match="has no inference network"):
        LatentAlignmentModel(network, ObjectiveConfig(), AlignmentConfig("hard"),
                             InferenceNetwork(network.source_embedding, network.target_embedding, 4))
    model = build("va-sample")
    src, src_mask, tgt_in, tgt_mask, _ = toy_batch()
    with pytest.raises(ValueError, match="pass tgt_out"):
        VariationalAlignmentGuide(model)(src, src_mask, tgt_in, tgt_mask)
    with pytest.raises(ValueError, match="has no infer=.*baseline"):
        toy = ToyAlignment(1.0)
        toy.baseline = None
        AlignmentELBO().differentiable_loss(toy.model, toy.guide)
    with pytest.raises(ValueError, match="use TraceMeanField_ELBO"):
        model = build("va-relaxed")
        AlignmentELBO().differentiable_loss(model.model, guide_for(model), *toy_batch())
    with pytest.raises(ValueError, match="Dirichlet weights: there is no categorical posterior"):
        build("va-relaxed").posterior_alignments(2, *toy_batch())
    with pytest.raises(ValueError, match="same mask"):
        alpha = torch.ones(2, 3)
        torch.distributions.kl_divergence(MaskedDirichlet(alpha, torch.tensor([True, True, False])),
                                          MaskedDirichlet(alpha, torch.tensor([True, False, False])))
    with pytest.raises(ValueError, match="at least one valid entry"):
        MaskedDirichlet(torch.ones(2, 3), torch.tensor([[True, True, False], [False, False, False]]))


def test_a_warm_start_refuses_a_training_pass_without_its_step():
    """The warm start's phase is a schedule of the training step the loop passes: an SVI loop that
    passes none would fit the Jensen bound forever, so the guide refuses, naming the argument;
    outside training (no gradients) the warm start is over."""
    model = build("va-relaxed")
    model.train()
    batch = toy_batch()
    guide, elbo = guide_for(model, warm_steps=3), elbo_for("va-relaxed")
    with pytest.raises(ValueError, match=r"Jensen warm start reads the training step: pass it, guide\(..., step=t\)"):
        elbo.differentiable_loss(model.model, guide, *batch)
    elbo.differentiable_loss(model.model, guide, *batch, step=3)
    with torch.no_grad():
        elbo.differentiable_loss(model.model, guide, *batch)
