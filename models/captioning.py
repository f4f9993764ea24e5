"""Att2in (Rennie et al. 2017; the BAM paper's appendix B.3) with Bayesian attention over the image grid.

    grid      v_i = dropout(relu(W_v I_i))               the 49 cells of the CNN grid, embedded
    scores    a_ti = w . tanh(W_I v_i + W_h h_{t-1})       additive attention, one query per step
    weights   W_t = BayesianAttention(a_t)                 one Pyro site per decoding step
    context   z_t = sum_i W_ti v_i
    LSTM      i, f, o = sigmoid(U x_t + V h_{t-1})         the gates do not see the image
              g = tanh(U_g x_t + V_g h_{t-1} + W_z z_t)    Att2in: the context enters the cell input only
              c_t = f c_{t-1} + i g,  h_t = o tanh(c_t)
    output    p(y_t | y_<t, I) = softmax(W_o dropout(h_t))

The attended context of step t changes h_t and so the attention of every later step: the draws
are sequential, and each step's weights are their own sample site (``attention``, ``attention#2``,
...; :mod:`bam_pyro.sites` numbers repeated calls), whose KL is analytic given the draws of the
steps before it (the paper's semi-analytic KL). The contextual prior reads the embedded cells, so
Psi is one distribution over the grid shared by all steps ("which regions matter in this photo"),
as in the paper's Figure 1.

The Pyro model is the translation task's :class:`models.nmt.Translator` (words observed in the
plates ``sentences`` x ``positions``, padding masked), with the grid as the source and one
attention site per target step (:class:`Captioner`). The network also has the interface of
:mod:`models.decoding` (``encode``, ``initial_state``, ``step``), so greedy and beam-search decoding
are the translation task's, and of :class:`bam_pyro.alignment.AlignmentNetwork`
(``decoder_states``, ``generate``), so hard attention is the latent-alignment package's
``hard`` variant (REINFORCE with the soft-attention baseline) on this network. For that family the
recurrence carries the soft context and the sampled cell enters the step's output only (the
translation model's input feeding, which makes the locations independent given the states); see
:meth:`CaptionNetwork.decoder_states`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from bam_pyro import BamConfig, BayesianAttention, DenseKeys, ObjectiveConfig
from bam_pyro.validation import whole_number
from models.nmt import DecoderOutputs, Memory, Translator


@dataclass(frozen=True)
class Att2inSizes:
    """Widths: word embedding, LSTM ``hidden`` (also the embedded cells'), the attention's inner
    layer; ``dropout`` on the embedded cells, the words and the output layer's input."""

    embedding: int = 256
    hidden: int = 256
    attention: int = 256
    dropout: float = 0.5

    def __post_init__(self) -> None:
        for name in ("embedding", "hidden", "attention"):
            whole_number(name, getattr(self, name))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class LstmState(NamedTuple):
    """The decoder's ``h`` and ``c`` ``[..., N, hidden]``."""

    hidden: Tensor
    cell: Tensor

    def select(self, index: Tensor) -> "LstmState":
        return LstmState(self.hidden.index_select(-2, index), self.cell.index_select(-2, index))


class CaptionNetwork(nn.Module):
    """Att2in over a grid of image features (see the module doc).

    ``forward(features, feature_mask, tgt_in, tgt_mask)`` -> logits ``[*draws, B, T, V]``, teacher
    forced: ``features`` ``[B, R, C]`` (R cells of C channels), ``feature_mask`` ``[B, R]`` (True:
    a real cell), ``tgt_in`` ``[B, T]`` word ids starting with BOS, ``tgt_mask`` ``[B, T]``.
    """

    def __init__(self, vocab_size: int, feature_size: int, sizes: Att2inSizes, attention: BamConfig) -> None:
        super().__init__()
        self.vocab_size, self.sizes = vocab_size, sizes
        hidden = sizes.hidden
        self.cell_embedding = nn.Linear(feature_size, hidden)
        self.word_embedding = nn.Embedding(vocab_size, sizes.embedding)
        self.score_key = nn.Linear(hidden, sizes.attention)
        self.score_query = nn.Linear(hidden, sizes.attention, bias=False)
        self.score_out = nn.Linear(sizes.attention, 1, bias=False)
        self.attention = BayesianAttention(attention, num_heads=1, key_dim=hidden)
        self.word_to_gates = nn.Linear(sizes.embedding, 4 * hidden)  # i, f, o and the cell input g
        self.hidden_to_gates = nn.Linear(hidden, 4 * hidden, bias=False)
        self.context_to_cell = nn.Linear(hidden, hidden, bias=False)
        self.output = nn.Linear(hidden, vocab_size)
        self.dropout = nn.Dropout(sizes.dropout)

    # --- the image and one step ---------------------------------------------------------------

    def encode(self, features: Tensor, feature_mask: Tensor) -> Memory:
        """Embedded cells ``[..., B, R, hidden]``, their attention projection ``W_I v``, the mask."""
        if features.dim() < 3 or feature_mask.shape != features.shape[-3:-1]:
            raise ValueError(f"features [B, cells, channels] {tuple(features.shape)} and feature_mask [B, cells] "
                             f"{tuple(feature_mask.shape)} do not match")
        cells = self.dropout(torch.relu(self.cell_embedding(features)))
        return Memory(cells, self.score_key(cells), feature_mask)

    def initial_state(self, memory: Memory) -> LstmState:
        zeros = memory.states.new_zeros(*memory.states.shape[:-2], self.sizes.hidden)
        return LstmState(zeros, zeros)

    def scores(self, memory: Memory, hidden: Tensor) -> Tensor:
        """``a_i = w . tanh(W_I v_i + W_h h)``: ``[..., N, hidden]`` -> ``[..., N, R]``."""
        return self.score_out(torch.tanh(memory.keys + self.score_query(hidden).unsqueeze(-2))).squeeze(-1)

    def gate_inputs(self, state: LstmState, words: Tensor) -> Tensor:
        """What :meth:`generate` needs of a step besides the context: the gates' pre-activations
        from the word and ``h_{t-1}`` ``[..., 4 hidden]`` and ``c_{t-1}``, side by side."""
        gates = self.word_to_gates(self.dropout(self.word_embedding(words))) + self.hidden_to_gates(state.hidden)
        return torch.cat([gates, state.cell.expand_as(gates[..., :self.sizes.hidden])], dim=-1)

    def lstm(self, inputs: Tensor, contexts: Tensor) -> LstmState:
        """The Att2in cell: ``inputs`` from :meth:`gate_inputs`, the context into the cell input."""
        hidden = self.sizes.hidden
        gates, previous = inputs[..., :4 * hidden], inputs[..., 4 * hidden:]
        i, f, o = torch.sigmoid(gates[..., :3 * hidden]).chunk(3, dim=-1)
        cell = f * previous + i * torch.tanh(gates[..., 3 * hidden:] + self.context_to_cell(contexts))
        return LstmState(o * torch.tanh(cell), cell)

    def generate(self, states: Tensor, contexts: Tensor) -> Tensor:
        """Word logits ``[..., V]`` of the steps ``states`` (:meth:`gate_inputs`) with the contexts
        ``contexts``; their leading dims broadcast (every cell of a step at once: hard attention)."""
        return self.output(self.dropout(self.lstm(states, contexts).hidden))

    @staticmethod
    def soft_context(scores: Tensor, memory: Memory) -> Tensor:
        weights = scores.masked_fill(~memory.mask, torch.finfo(scores.dtype).min).softmax(-1)
        return torch.matmul(weights.unsqueeze(-2), memory.states).squeeze(-2)

    def step(self, memory: Memory, state: LstmState, words: Tensor) -> tuple[DecoderOutputs, LstmState]:
        """One step with the soft (posterior-mean) context: previous words ``[N]`` -> the step's
        outputs (for :meth:`generate`) and the next state (what :mod:`models.decoding` calls)."""
        scores = self.scores(memory, state.hidden)
        context = self.soft_context(scores, memory)
        inputs = self.gate_inputs(state, words)
        return DecoderOutputs(inputs, scores, context), self.lstm(inputs, context)

    # --- whole captions -----------------------------------------------------------------------

    def decoder_states(self, memory: Memory, tgt_in: Tensor) -> DecoderOutputs:
        """Every step teacher forced with the soft context carried in the recurrence: ``[B, T, .]``.

        The latent-alignment models (hard attention) read these: their sampled cell ``z_t`` enters
        the cell input of step t's output (``generate(states[t], v_{z_t})``), while the recurrence
        goes on with the soft context, so the locations are independent given the states."""
        state, steps = self.initial_state(memory), []
        for t in range(tgt_in.size(-1)):
            outputs, state = self.step(memory, state, tgt_in[..., t])
            steps.append(outputs)
        return DecoderOutputs(*(torch.stack(parts, dim=-2) for parts in zip(*steps)))

    def attention_weights(self, scores: Tensor, memory: Memory, query_mask: Tensor) -> Tensor:
        """One step's Bayesian attention: scores ``[..., B, R]`` -> weights ``[..., B, R]`` (a Pyro
        site inside a model; soft in eval mode outside one). Finished captions carry no KL."""
        axis = DenseKeys(memory.mask[:, None, None, :], query_mask=query_mask[:, None, None, None])
        keys = memory.states.unsqueeze(-2)  # [B, R, heads=1, hidden]: the contextual prior's input
        return self.attention(scores[..., None, None, :], keys, axis)[..., 0, 0, :]

    def forward(self, features: Tensor, feature_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor) -> Tensor:
        memory = self.encode(features, feature_mask)
        state, logits = self.initial_state(memory), []
        for t in range(tgt_in.size(1)):
            weights = self.attention_weights(self.scores(memory, state.hidden), memory, tgt_mask[:, t])
            context = torch.matmul(weights.unsqueeze(-2), memory.states).squeeze(-2)
            state = self.lstm(self.gate_inputs(state, tgt_in[:, t]), context)
            logits.append(self.output(self.dropout(state.hidden)))
        return torch.stack(logits, dim=-2)


class Captioner(Translator):
    """Pyro model of captions given photos: ``model(features, feature_mask, tgt_in, tgt_mask,
    tgt_out=None)``, one attention site per target step. Under the ``mean`` reduction the KL is
    the per-entry KL averaged over the grid and over the steps of the batch (L = its length)."""

    network: CaptionNetwork

    def model(self, features: Tensor, feature_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor,
              tgt_out: Optional[Tensor] = None, step: Optional[int] = None) -> Tensor:
        if self.network.attention.config.prior is not None:
            self.num_sites = tgt_in.size(1)
        return super().model(features, feature_mask, tgt_in, tgt_mask, tgt_out, step=step)


def build_captioner(vocab_size: int, feature_size: int, sizes: Att2inSizes, attention: BamConfig,
                    objective: ObjectiveConfig) -> Captioner:
    return Captioner(CaptionNetwork(vocab_size, feature_size, sizes, attention), objective)
