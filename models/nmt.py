"""The LSTM translation model of Deng et al. (2018), with Bayesian attention (Fan et al. 2020, 4.4).

    memory     x_1 .. x_S = BiLSTM(embed(source))
    decoder    h_j = LSTM([embed(y_{j-1}); cbar_{j-1}], h_{j-1})     input feeding of the soft context
    scores     a_ji = v . tanh(W_q h_j + W_k x_i)                      MLP (additive) attention
    soft       cbar_j = sum_i softmax_i(a_j)_i x_i
    attention  W = BayesianAttention(a) over all (j, i) at once           one Pyro site per batch
    output     p(y_j | x, y_<j, W_j) = softmax(W_o tanh(L [h_j; c_j])),  c_j = sum_i W_ji x_i

Because the decoder is fed the *soft* context, its states h_j and scores a_j are a deterministic
function of (x, y_<j): the recurrent loop computes them for every target step, and the stochastic
weights of all steps are then one call of :class:`bam_pyro.BayesianAttention` over ``[batch,
target, source]`` entries: one sample site per sentence batch, each entry's KL analytic, the
contextual prior computed from the encoder states once per sentence and shared by every target
step. Posterior draws only broadcast through that call and the output layer.

The interface other attention models reuse (the latent-alignment family of Deng et al. in
:mod:`bam_pyro.alignment`), all on :class:`Seq2Seq`:

- ``encode(src, src_mask) -> Memory``: encoder states ``[B, S, E]``, their attention
  projection ``W_k x`` ``[B, S, A]`` and the source mask;
- ``decoder_states(memory, tgt_in) -> DecoderOutputs``: teacher-forced states ``[B, T, D]``,
  attention scores ``[B, T, S]`` (unmasked: mask with ``memory.mask``) and soft contexts
  ``[B, T, E]``; ``initial_state`` and ``step`` give the same one step at a time (decoding);
- ``generate(states, contexts) -> logits``: the output layer. It broadcasts, so
  ``generate(states[:, :, None], memory.states[:, None])`` gives the logits of every alignment
  ``[B, T, S, V]`` (hard attention: the context is one encoder state);
- ``attention_weights(scores, memory, tgt_mask)``: the Bayesian attention call;
  ``context(weights, memory)``: ``sum_i W_ji x_i``; ``vocab_size``, ``source_embedding`` and
  ``target_embedding`` (an inference network may share them).

:class:`Translator` is the Pyro model (a :class:`bam_pyro.BamModel`): ``model(src, src_mask,
tgt_in, tgt_mask, tgt_out=None)`` observes ``tgt_out`` in the plates ``sentences`` x
``positions`` (:meth:`Translator.target_plates`), target padding masked out. What evaluation and
decoding read of any translation model: ``log_probs`` (next-token log-probabilities of every
target step, as the model predicts: here with the posterior-mean attention, i.e. soft) and
``next_token_log_probs`` (the same for one decoding step).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple, Optional

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from bam_pyro import BamConfig, BamModel, BayesianAttention, DenseKeys, ObjectiveConfig
from bam_pyro.alignment import target_plates
from bam_pyro.host_reads import value_checks_enabled
from bam_pyro.validation import whole_number

#: range of the uniform initialization of the network's weights (OpenNMT's default, as Deng et al.)
INIT_RANGE = 0.1


@dataclass(frozen=True)
class NetworkSizes:
    """Sizes of the network. ``encoder``: hidden units per direction (states are ``2 * encoder``);
    ``layers``: of the encoder and of the decoder; ``dropout``: on embeddings, between LSTM layers
    and on the output layer's hidden vector."""

    embedding: int
    encoder: int
    decoder: int
    attention: int
    layers: int
    dropout: float

    def __post_init__(self) -> None:
        for name in ("embedding", "encoder", "decoder", "attention", "layers"):
            whole_number(name, getattr(self, name))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


#: ``paper``: Deng et al.'s IWSLT model (their va.sh: 512 embeddings, 2 x 512-unit BiLSTM layers, 2 x
#: 768-unit decoder layers, attention 512, dropout 0.3), for a GPU: 52.9M parameters at 14k pieces
#: (the paper's Table 8 says 42M), 42.1M at 8k. ``cpu``: one layer of 256 units, 8.91M parameters at
#: 8k pieces (BAM-WC's prior adds 2.6k). ``tiny``: a smoke test of the whole pipeline in seconds.
PRESETS = {
    "paper": NetworkSizes(embedding=512, encoder=512, decoder=768, attention=512, layers=2, dropout=0.3),
    "cpu": NetworkSizes(embedding=256, encoder=256, decoder=256, attention=256, layers=1, dropout=0.3),
    "tiny": NetworkSizes(embedding=32, encoder=32, decoder=32, attention=32, layers=1, dropout=0.0),
}


class Memory(NamedTuple):
    """The encoded source: states ``[N, S, E]``, their attention keys ``W_k x`` ``[N, S, A]``, mask ``[N, S]``."""

    states: Tensor
    keys: Tensor
    mask: Tensor

    def select(self, index: Tensor) -> "Memory":
        """The rows ``index`` (e.g. each sentence repeated once per beam)."""
        return Memory(*(t.index_select(0, index) for t in self))


class DecoderState(NamedTuple):
    """The recurrent state between steps: per-layer ``h`` and ``c`` ``[N, D]`` and the soft context
    ``[N, E]`` fed to the next step."""

    hidden: tuple[Tensor, ...]
    cell: tuple[Tensor, ...]
    feed: Tensor

    def select(self, index: Tensor) -> "DecoderState":
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        return DecoderState(tuple(map(pick, self.hidden)), tuple(map(pick, self.cell)), pick(self.feed))


class DecoderOutputs(NamedTuple):
    """Per target step: top decoder state (the query) ``[..., D]``, attention scores ``[..., S]``
    (padded sources not yet masked) and soft context ``[..., E]``; ``...`` is ``N`` for one step,
    ``B, T`` for a teacher-forced sentence."""

    states: Tensor
    scores: Tensor
    contexts: Tensor


class LogSoftmaxCategorical(dist.Categorical):
    """``Categorical(logits=...)`` normalized by one fused ``log_softmax``.

    torch normalizes as ``logits - logsumexp(logits)``, whose passes over ``[B, T, vocabulary]`` and
    their backward cost twice the time of ``log_softmax`` (measured: 0.65 s against 0.28 s per
    batch of 64 x 17 x 8000 on one thread), a sizeable part of a training step. Same values."""

    def __init__(self, logits: Tensor, validate_args: Optional[bool] = None) -> None:
        self.logits = logits.log_softmax(-1)
        self._param, self._num_events = self.logits, logits.size(-1)
        torch.distributions.Distribution.__init__(self, logits.shape[:-1], validate_args=validate_args)

    def expand(self, batch_shape, _instance=None) -> "LogSoftmaxCategorical":
        return super().expand(batch_shape, _instance=self._get_checked_instance(LogSoftmaxCategorical, _instance))


class Seq2Seq(nn.Module):
    """Bidirectional LSTM encoder, input-feeding LSTM decoder, MLP attention (see module doc)."""

    def __init__(self, vocab_size: int, sizes: NetworkSizes, attention: BamConfig) -> None:
        super().__init__()
        self.sizes, self.vocab_size = sizes, vocab_size
        memory_size = 2 * sizes.encoder
        inner_dropout = sizes.dropout if sizes.layers > 1 else 0.0
        self.source_embedding = nn.Embedding(vocab_size, sizes.embedding)
        self.target_embedding = nn.Embedding(vocab_size, sizes.embedding)
        self.encoder = nn.LSTM(sizes.embedding, sizes.encoder, sizes.layers, batch_first=True,
                               bidirectional=True, dropout=inner_dropout)
        # the decoder's initial h and c per layer from the encoder's final states (both directions)
        self.bridge = nn.Linear(memory_size, 2 * sizes.layers * sizes.decoder)
        self.decoder = nn.ModuleList(
            nn.LSTMCell((sizes.embedding + memory_size) if layer == 0 else sizes.decoder, sizes.decoder)
            for layer in range(sizes.layers)
        )
        self.score_query = nn.Linear(sizes.decoder, sizes.attention)
        self.score_key = nn.Linear(memory_size, sizes.attention, bias=False)
        self.score_out = nn.Linear(sizes.attention, 1, bias=False)
        self.attention = BayesianAttention(attention, num_heads=1, key_dim=memory_size)
        # L [h; c] as L_h h + L_c c, so that generate() broadcasts without concatenating
        self.output_state = nn.Linear(sizes.decoder, sizes.decoder)
        self.output_context = nn.Linear(memory_size, sizes.decoder, bias=False)
        self.output = nn.Linear(sizes.decoder, vocab_size)
        self.dropout = nn.Dropout(sizes.dropout)
        for name, parameter in self.named_parameters():
            if not name.startswith("attention."):  # the contextual prior keeps its own init
                nn.init.uniform_(parameter, -INIT_RANGE, INIT_RANGE)

    # --- encoder ----------------------------------------------------------------------------

    def encode(self, src: Tensor, src_mask: Tensor) -> Memory:
        """``src``, ``src_mask``: ``[B, S]`` ids and True at real tokens (padding on the right)."""
        lengths = src_mask.sum(-1)
        if value_checks_enabled(lengths) and bool((lengths == 0).any()):
            rows = (lengths == 0).nonzero().flatten().tolist()
            raise ValueError(f"empty source sentence in the batch (rows {rows[:5]})")
        packed = pack_padded_sequence(self.dropout(self.source_embedding(src)), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        states, _ = self.encoder(packed)
        states, _ = pad_packed_sequence(states, batch_first=True, total_length=src.size(1))
        return Memory(states, self.score_key(states), src_mask)

    def initial_state(self, memory: Memory) -> DecoderState:
        """The decoder's state before the first target token, from the encoder's final states."""
        final = self._final_states(memory)
        h, c = torch.tanh(self.bridge(final)).chunk(2, dim=-1)
        layers = self.sizes.layers
        feed = memory.states.new_zeros(memory.states.size(0), memory.states.size(-1))
        return DecoderState(h.chunk(layers, dim=-1), c.chunk(layers, dim=-1), feed)

    def _final_states(self, memory: Memory) -> Tensor:
        """Top layer's forward state at each sentence's last token and backward state at its first
        (the final states of both directions): ``[N, 2 * encoder]``."""
        half = self.sizes.encoder
        last = (memory.mask.sum(-1) - 1).clamp_min(0)
        rows = torch.arange(memory.states.size(0), device=last.device)
        return torch.cat([memory.states[rows, last, :half], memory.states[:, 0, half:]], dim=-1)

    # --- decoder ----------------------------------------------------------------------------

    def scores(self, memory: Memory, query: Tensor) -> Tensor:
        """MLP attention scores ``v . tanh(W_q h + W_k x_i)``: query ``[N, D]`` -> ``[N, S]``."""
        return self.score_out(torch.tanh(memory.keys + self.score_query(query).unsqueeze(-2))).squeeze(-1)

    def _advance(self, memory: Memory, state: DecoderState, embedded: Tensor) -> tuple[DecoderOutputs, DecoderState]:
        inputs = torch.cat([embedded, state.feed], dim=-1)
        hidden, cell = [], []
        for layer, lstm in enumerate(self.decoder):
            h, c = lstm(inputs, (state.hidden[layer], state.cell[layer]))
            hidden.append(h)
            cell.append(c)
            inputs = self.dropout(h) if layer + 1 < len(self.decoder) else h
        scores = self.scores(memory, inputs)
        soft = scores.masked_fill(~memory.mask, torch.finfo(scores.dtype).min).softmax(-1)
        context = torch.bmm(soft.unsqueeze(1), memory.states).squeeze(1)
        return DecoderOutputs(inputs, scores, context), DecoderState(tuple(hidden), tuple(cell), context)

    def step(self, memory: Memory, state: DecoderState, tokens: Tensor) -> tuple[DecoderOutputs, DecoderState]:
        """One decoding step: previous tokens ``[N]`` -> this step's outputs and the next state."""
        return self._advance(memory, state, self.dropout(self.target_embedding(tokens)))

    def decoder_states(self, memory: Memory, tgt_in: Tensor) -> DecoderOutputs:
        """Teacher-forced outputs of every target step: ``[B, T, D]``, ``[B, T, S]``, ``[B, T, E]``."""
        embedded = self.dropout(self.target_embedding(tgt_in))
        state = self.initial_state(memory)
        steps = []
        for j in range(tgt_in.size(1)):
            outputs, state = self._advance(memory, state, embedded[:, j])
            steps.append(outputs)
        return DecoderOutputs(*(torch.stack(parts, dim=1) for parts in zip(*steps)))

    # --- attention and output ---------------------------------------------------------------

    def attention_weights(self, scores: Tensor, memory: Memory, tgt_mask: Tensor) -> Tensor:
        """The Bayesian attention of all target steps in one call: scores ``[B, T, S]`` -> weights
        ``[*draws, B, T, S]`` (a Pyro site inside a model; soft in eval mode outside one)."""
        axis = DenseKeys(memory.mask[:, None, None, :], query_mask=tgt_mask[:, None, :, None])  # padded steps: no KL
        keys = memory.states.unsqueeze(-2)  # [B, S, heads=1, E]: the contextual prior's input
        return self.attention(scores.unsqueeze(-3), keys, axis).squeeze(-3)

    @staticmethod
    def context(weights: Tensor, memory: Memory) -> Tensor:
        """``c_j = sum_i W_ji x_i``: ``[*draws, B, T, S]`` -> ``[*draws, B, T, E]``."""
        return torch.matmul(weights, memory.states)

    def generate(self, states: Tensor, contexts: Tensor) -> Tensor:
        """Output logits ``W_o tanh(L_h h + L_c c)``; leading dims of the two broadcast."""
        hidden = torch.tanh(self.output_state(states) + self.output_context(contexts))
        return self.output(self.dropout(hidden))

    def forward(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor) -> Tensor:
        """Logits ``[*draws, B, T, V]`` of every target step, teacher forced."""
        memory = self.encode(src, src_mask)
        outputs = self.decoder_states(memory, tgt_in)
        weights = self.attention_weights(outputs.scores, memory, tgt_mask)
        return self.generate(outputs.states, self.context(weights, memory))


class Translator(BamModel):
    """Pyro model of target sentences given source sentences (see module doc)."""

    network: Seq2Seq

    def model(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor, tgt_out: Optional[Tensor] = None,
              step: Optional[int] = None) -> Tensor:
        return super().model(src, src_mask, tgt_in, tgt_mask, tgt_out=tgt_out, tgt_mask=tgt_mask, step=step)

    def target_plates(self, tgt_mask: Tensor) -> contextlib.AbstractContextManager[None]:
        return target_plates(tgt_mask, self.objective.reduction)

    def likelihood(self, logits: Tensor, tgt_out: Optional[Tensor] = None, tgt_mask: Optional[Tensor] = None) -> None:
        # a vectorized draw arrives as [*draws, 1, 1, B, T, V]: drop the two plate slots
        logits = self.align_to_plate(self.align_to_plate(logits, ndim=3), ndim=3)
        with self.target_plates(tgt_mask):
            pyro.sample("y", LogSoftmaxCategorical(logits), obs=tgt_out)

    def log_probs(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor) -> Tensor:
        """Next-token log-probabilities ``[B, T, V]`` of every target step (in eval mode with the
        posterior-mean attention, which is soft attention)."""
        return self.network(src, src_mask, tgt_in, tgt_mask).log_softmax(-1)

    def next_token_log_probs(self, memory: Memory, outputs: DecoderOutputs) -> Tensor:
        """One decoding step's log-probabilities ``[N, V]`` with the posterior-mean (soft) context."""
        return self.network.generate(outputs.states, outputs.contexts).log_softmax(-1)


def build_translator(vocab_size: int, sizes: NetworkSizes, attention: BamConfig, objective: ObjectiveConfig) -> Translator:
    return Translator(Seq2Seq(vocab_size, sizes, attention), objective)
