"""Greedy and beam-search decoding: on a hand-made Markov chain whose best sentence greedy misses,
and on the translation network (beam width 1 is greedy; a batch decodes as its sentences alone)."""

import numpy as np
import pytest
import torch
from torch import nn

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.training import SVITrainer
from experiments.nmt.multi30k import BOS, EOS, make_batch
from models.decoding import beam_hypotheses, beam_search, greedy
from models.nmt import DecoderOutputs, DecoderState, Memory, NetworkSizes, build_translator

A, B, C = 4, 5, 6


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


class ChainNetwork(nn.Module):
    """A decoder whose only state is the previous token (passed on as the step's ``states``)."""

    def encode(self, src, src_mask):
        return Memory(src[..., None].float(), src[..., None].float(), src_mask)

    def initial_state(self, memory):
        zeros = torch.zeros(memory.mask.size(0))
        return DecoderState((zeros,), (zeros,), zeros[:, None])

    def step(self, memory, state, tokens):
        return DecoderOutputs(tokens, torch.zeros_like(memory.mask, dtype=torch.float), state.feed), state


class ChainModel(nn.Module):
    """Next-token probabilities read from a table indexed by the previous token.

    From BOS: a 0.6, b 0.4; after a: b 0.36, c 0.34, EOS 0.3; after b or c: EOS 0.9. Greedy says
    "a b" (probability 0.6 * 0.36 * 0.9 = 0.194), the most probable sentence is "b" (0.4 * 0.9)."""

    def __init__(self):
        super().__init__()
        self.network = ChainNetwork()
        table = torch.full((7, 7), 1e-6)
        table[BOS, [A, B]] = torch.tensor([0.6, 0.4])
        table[A, [B, C, EOS]] = torch.tensor([0.36, 0.34, 0.3])
        table[[B, C], EOS] = 0.9
        table[[B, C], A] = 0.1
        self.log_table = (table / table.sum(-1, keepdim=True)).log()

    def next_token_log_probs(self, memory, outputs):
        return self.log_table[outputs.states]


def test_beam_search_finds_the_sentence_greedy_misses():
    model = ChainModel()
    src = torch.tensor([[7], [7]])
    mask = torch.ones_like(src, dtype=torch.bool)
    assert greedy(model, src, mask, BOS, EOS) == [[A, B], [A, B]]
    assert beam_search(model, src, mask, BOS, EOS, beam_size=1, length_penalty=0.0) == [[A, B], [A, B]]
    assert beam_search(model, src, mask, BOS, EOS, beam_size=2, length_penalty=0.0) == [[B], [B]]
    # log 0.36 / lp(2) against log 0.194 / lp(3): a strong length penalty prefers the longer one
    assert beam_search(model, src, mask, BOS, EOS, beam_size=2, length_penalty=1.0) == [[B], [B]]
    assert beam_search(model, src, mask, BOS, EOS, beam_size=2, length_penalty=5.0) == [[A, B], [A, B]]


def test_the_length_limit_ends_open_hypotheses():
    model = ChainModel()
    model.log_table[[B, C], EOS] = -30.0  # never ends after b or c: a b a b ...
    src, mask = torch.tensor([[7]]), torch.ones(1, 1, dtype=torch.bool)
    assert greedy(model, src, mask, BOS, EOS, max_length=4) == [[A, B, A, B]]
    assert beam_search(model, src, mask, BOS, EOS, beam_size=1, max_length=4) == [[A, B, A, B]]
    with pytest.raises(ValueError, match="beam_size must be a whole number >= 1"):
        beam_search(model, src, mask, BOS, EOS, beam_size=0)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_each_sentence_has_its_own_default_length_limit_in_any_batch(beam_size):
    """A model that never ends stops at twice its own source plus 10 tokens, alone or beside a
    longer sentence (not at the batch's longest source)."""
    model = ChainModel()
    model.log_table[:, EOS] = -30.0  # a b a b ...: no hypothesis ever ends
    src = torch.tensor([[7, 0, 0, 0], [7, 7, 7, 7]])
    mask = src != 0
    for decode in (lambda s, m: greedy(model, s, m, BOS, EOS),
                   lambda s, m: beam_search(model, s, m, BOS, EOS, beam_size=beam_size)):
        together = decode(src, mask)
        assert [len(out) for out in together] == [2 * 1 + 10, 2 * 4 + 10]
        assert decode(src[:1, :1], mask[:1, :1]) == together[:1]


@pytest.fixture(scope="module")
def copier():
    """A small translator trained for a few seconds to copy its input: its outputs end at
    different lengths. Left in training mode (dropout 0.3): decoding must switch to eval mode."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    sizes = NetworkSizes(embedding=16, encoder=16, decoder=16, attention=16, layers=2, dropout=0.3)
    model = build_translator(12, sizes, BamConfig(variant="wc", k=5.0, d_mid=5), ObjectiveConfig())
    trainer = SVITrainer(model, AttentionGuide(model.model), torch.optim.Adam(model.parameters(), lr=1e-2))
    for _ in range(60):
        copied = [rng.integers(4, 12, size=rng.integers(1, 8)) for _ in range(16)]
        args, kwargs = make_batch(copied, copied).model_args
        trainer.step(*args, **kwargs)
    return model


def sources():
    g = torch.Generator().manual_seed(0)
    lengths = [2, 7, 4, 1, 6]
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(4, 12, (n,), generator=g)
    return src, src != 0


def test_beam_width_one_is_greedy_on_the_translation_network(copier):
    model = copier
    src, mask = sources()
    expected = greedy(model, src, mask, BOS, EOS)
    assert len({len(out) for out in expected}) > 2  # the sentences end at different steps
    assert beam_search(model, src, mask, BOS, EOS, beam_size=1) == expected
    assert model.training  # the mode is restored


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_batch_decodes_as_its_sentences_alone(beam_size, copier):
    model = copier
    src, mask = sources()
    together = beam_search(model, src, mask, BOS, EOS, beam_size=beam_size, max_length=20)
    for row in range(src.size(0)):
        n = int(mask[row].sum())
        alone = beam_search(model, src[row : row + 1, :n], mask[row : row + 1, :n], BOS, EOS, beam_size=beam_size,
                            max_length=20)
        assert alone == [together[row]]


def test_every_hypothesis_scores_its_teacher_forced_log_probability(copier):
    """The score beam search keeps for a hypothesis is the model's log-probability of it: the
    states were carried along with the right beams."""
    src, mask = sources()
    max_length = 9
    found = beam_hypotheses(copier, src, mask, BOS, EOS, beam_size=4, length_penalty=1.0, max_length=max_length)
    copier.eval()
    try:
        for row, hypotheses in enumerate(found):
            assert len(hypotheses) >= 4 and hypotheses == sorted(hypotheses, key=lambda h: -h.score)
            for tokens, log_prob, score in hypotheses:
                ended = len(tokens) < max_length  # by EOS, else at the length limit
                target = torch.tensor([tokens + [EOS] if ended else tokens])
                tgt_in = torch.cat([torch.tensor([[BOS]]), target[:, :-1]], dim=-1)
                n = int(mask[row].sum())
                forced = copier.log_probs(src[row : row + 1, :n], mask[row : row + 1, :n], tgt_in, torch.ones_like(tgt_in, dtype=torch.bool))
                assert forced.gather(-1, target.unsqueeze(-1)).sum().item() == pytest.approx(log_prob, abs=1e-4)
                assert score == pytest.approx(log_prob / ((5 + target.size(1)) / 6))
    finally:
        copier.train()
