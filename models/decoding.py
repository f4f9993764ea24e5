"""Greedy and beam-search decoding of any translation model built on :class:`models.nmt.Seq2Seq`.

A model decodes through two things: its network's ``encode`` / ``initial_state`` / ``step`` (the
recurrent decoder, :mod:`models.nmt`) and its own ``next_token_log_probs(memory, outputs)``, the
log-probabilities of the next token as the model predicts it (soft and BAM: with the
posterior-mean attention, which is soft attention; latent-alignment models: enumerating the
alignment). Both functions run the model in eval mode and restore its mode afterwards.

Beam search keeps ``beam_size`` open hypotheses per sentence for all sentences of a batch at once.
A hypothesis that emits EOS among the best ``beam_size`` candidates of a step is finished with the
score ``log p(y) / lp(|y|)``, ``lp(n) = ((5 + n) / 6) ** length_penalty`` (Wu et al. 2016;
``|y|`` counts EOS), and the best ``beam_size`` candidates that do not end stay open. A sentence is
done once it has ``beam_size`` finished hypotheses none of which the best open one, scored at its
current length, would beat; hypotheses still open at its length limit are finished there (by
default twice its own source plus 10 tokens, so a sentence decodes the same in any batch). The best
finished score wins. With ``beam_size=1`` this is exactly greedy decoding: the hypothesis that stays
open when EOS is the best candidate scores below it at the same length.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional, Protocol

import torch
from torch import Tensor, nn

from bam_pyro.validation import positive, whole_number
from models.nmt import DecoderOutputs, Memory, Seq2Seq


class StepwiseTranslator(Protocol):
    """What decoding needs of a model (see module doc)."""

    network: Seq2Seq

    def next_token_log_probs(self, memory: Memory, outputs: DecoderOutputs) -> Tensor: ...

    def train(self, mode: bool = True) -> nn.Module: ...

    training: bool


def length_limits(src_mask: Tensor, max_length: Optional[int] = None) -> list[int]:
    """Each sentence's output length limit: ``max_length``, else twice its own source plus 10
    tokens (its own, not the batch's longest: the output must not depend on the batch)."""
    if max_length:
        return [max_length] * src_mask.size(0)
    return (2 * src_mask.sum(-1) + 10).tolist()


def length_penalty_factor(length: Tensor, alpha: float) -> Tensor:
    """Wu et al.'s ``((5 + length) / 6) ** alpha``."""
    return ((5.0 + length) / 6.0) ** alpha


@contextmanager
def _eval_mode(model: StepwiseTranslator) -> Iterator[None]:
    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def greedy(model: StepwiseTranslator, src: Tensor, src_mask: Tensor, bos: int, eos: int,
           max_length: Optional[int] = None) -> list[list[int]]:
    """The most probable next token at every step until EOS or the sentence's length limit
    (:func:`length_limits`); returns each sentence's ids (no EOS)."""
    limits = length_limits(src_mask, max_length)
    with _eval_mode(model):
        network = model.network
        memory = network.encode(src, src_mask)
        state = network.initial_state(memory)
        tokens = torch.full((src.size(0),), bos, dtype=torch.long, device=src.device)
        outputs: list[list[int]] = [[] for _ in range(src.size(0))]
        open_rows = list(range(src.size(0)))  # sentences not finished, in the order of the rows
        for length in range(1, max(limits, default=0) + 1):
            step, state = network.step(memory, state, tokens)
            tokens = model.next_token_log_probs(memory, step).argmax(-1)
            keep = []
            for row, token in enumerate(tokens.tolist()):
                if token == eos:
                    continue
                outputs[open_rows[row]].append(token)
                if length < limits[open_rows[row]]:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(open_rows):
                index = torch.tensor(keep, device=src.device)
                memory, state, tokens = memory.select(index), state.select(index), tokens.index_select(0, index)
                open_rows = [open_rows[row] for row in keep]
        return outputs


class Hypothesis(NamedTuple):
    """A finished beam-search hypothesis: its ids (no EOS), ``log p(ids [+ EOS])`` and the score
    that ranks it, that log-probability over the length penalty."""

    tokens: list[int]
    log_prob: float
    score: float


def _settled(finished: list[Hypothesis], k: int, open_best: float) -> bool:
    """A sentence is done when its ``k`` best finished hypotheses all score at least as well as the
    best open one would if it ended now (Hugging Face's rule): finished hypotheses that rank low
    (an early EOS of a near-certain model) do not end the search while a better one is open."""
    if len(finished) < k:
        return False
    return sorted(h.score for h in finished)[-k] >= open_best


def beam_search(model: StepwiseTranslator, src: Tensor, src_mask: Tensor, bos: int, eos: int, beam_size: int = 10,
                length_penalty: float = 1.0, max_length: Optional[int] = None) -> list[list[int]]:
    """The best hypothesis of a batched beam search (see module doc); each sentence's ids, no EOS."""
    found = beam_hypotheses(model, src, src_mask, bos, eos, beam_size, length_penalty, max_length)
    return [hypotheses[0].tokens for hypotheses in found]


def beam_hypotheses(model: StepwiseTranslator, src: Tensor, src_mask: Tensor, bos: int, eos: int, beam_size: int = 10,
                    length_penalty: float = 1.0, max_length: Optional[int] = None) -> list[list[Hypothesis]]:
    """Every hypothesis a batched beam search finishes, per sentence, best first (see module doc)."""
    whole_number("beam_size", beam_size)
    positive("length_penalty", length_penalty, strict=False)
    limits = length_limits(src_mask, max_length)
    batch, k = src.size(0), beam_size
    with _eval_mode(model):
        network = model.network
        memory = network.encode(src, src_mask)
        rows = torch.arange(batch, device=src.device).repeat_interleave(k)
        memory = memory.select(rows)
        state = network.initial_state(memory)
        tokens = torch.full((batch * k,), bos, dtype=torch.long, device=src.device)
        scores = torch.full((batch, k), float("-inf"), device=src.device)
        scores[:, 0] = 0.0  # one live hypothesis per sentence at the start
        prefixes = torch.empty(batch, k, 0, dtype=torch.long, device=src.device)
        finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
        sentences = list(range(batch))  # the sentence of each block of k rows still decoded
        for length in range(1, max(limits, default=0) + 1):
            step, state = network.step(memory, state, tokens)
            log_probs = model.next_token_log_probs(memory, step)
            vocab = log_probs.size(-1)
            candidates = scores.unsqueeze(-1) + log_probs.view(len(sentences), k, vocab)
            top_scores, top = candidates.view(len(sentences), -1).topk(min(2 * k, k * vocab), dim=-1)
            origin, token = top // vocab, top % vocab
            is_eos = token == eos
            # EOS among the best k candidates finishes a hypothesis
            penalty = float(length_penalty_factor(torch.tensor(float(length)), length_penalty))
            for block, rank in (is_eos[:, :k] & torch.isfinite(top_scores[:, :k])).nonzero().tolist():
                log_prob = float(top_scores[block, rank])
                prefix = prefixes[block, origin[block, rank]].tolist()
                finished[sentences[block]].append(Hypothesis(prefix, log_prob, log_prob / penalty))
            # the best k candidates that do not end, in rank order, live on
            rank_order = torch.arange(top.size(-1), device=src.device).expand_as(top)
            chosen = (rank_order + is_eos * top.size(-1)).argsort(dim=-1, stable=True)[:, :k]
            origin, token = origin.gather(-1, chosen), token.gather(-1, chosen)
            scores = top_scores.gather(-1, chosen)
            prefixes = torch.cat([prefixes.gather(1, origin.unsqueeze(-1).expand(-1, -1, prefixes.size(-1))),
                                  token.unsqueeze(-1)], dim=-1)
            flat_origin = (origin + torch.arange(len(sentences), device=src.device).unsqueeze(-1) * k).flatten()
            state, tokens = state.select(flat_origin), token.flatten()
            open_best = (scores.max(-1).values / penalty).tolist()
            live = []
            for block, sentence in enumerate(sentences):
                if _settled(finished[sentence], k, open_best[block]):
                    continue
                if length < limits[sentence]:
                    live.append(block)
                    continue
                for beam in range(k):  # its length limit: the hypotheses still open finish here
                    log_prob = float(scores[block, beam])
                    if math.isfinite(log_prob):
                        finished[sentence].append(Hypothesis(prefixes[block, beam].tolist(), log_prob, log_prob / penalty))
            if not live:
                break
            if len(live) < len(sentences):
                blocks = torch.tensor(live, device=src.device)
                index = (blocks.unsqueeze(-1) * k + torch.arange(k, device=src.device)).flatten()
                memory, state, tokens = memory.select(index), state.select(index), tokens.index_select(0, index)
                scores, prefixes = scores.index_select(0, blocks), prefixes.index_select(0, blocks)
                sentences = [sentences[b] for b in live]
        return [sorted(hypotheses, key=lambda h: -h.score) for hypotheses in finished]
