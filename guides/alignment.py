"""The inference network of variational attention (Deng et al. 2018, section 4): q(z_j | x, y)
from the source and the *whole* target, a bidirectional LSTM over each and bilinear scores
``s_ji = g_j^T U f_i`` between target state g_j and source state f_i. Categorical:
``q(z_j = i) = softmax_i(s_ji)``; relaxed: ``Dirichlet(exp(s_j))``. The word embeddings are the
translation network's (shared, as in the paper); everything else is the guide's own. The guides
that use it are :mod:`bam_pyro.alignment.guides`.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from bam_pyro.validation import whole_number


class InferenceNetwork(nn.Module):
    """Scores ``[B, T, S]`` of q(z_j = i | x, y) from the source and the whole target (see module doc).

    ``source_embedding``, ``target_embedding``: shared with the translation network.
    ``hidden``: units per direction of each bidirectional LSTM; ``layers``: of each (the paper: 2).
    ``dropout``: on the embeddings, between layers and on the states. Padded sources are not masked here.
    """

    def __init__(self, source_embedding: nn.Embedding, target_embedding: nn.Embedding, hidden: int,
                 layers: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        whole_number("hidden", hidden)
        whole_number("layers", layers)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.source_embedding, self.target_embedding = source_embedding, target_embedding
        inner_dropout = dropout if layers > 1 else 0.0
        self.source_rnn = nn.LSTM(source_embedding.embedding_dim, hidden, layers, batch_first=True,
                                  bidirectional=True, dropout=inner_dropout)
        self.target_rnn = nn.LSTM(target_embedding.embedding_dim, hidden, layers, batch_first=True,
                                  bidirectional=True, dropout=inner_dropout)
        self.bilinear = nn.Linear(2 * hidden, 2 * hidden, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src: Tensor, src_mask: Tensor, tgt_out: Tensor, tgt_mask: Tensor) -> Tensor:
        source = self._read(self.source_rnn, self.source_embedding(src), src_mask)
        target = self._read(self.target_rnn, self.target_embedding(tgt_out), tgt_mask)
        return self.bilinear(target) @ source.transpose(-1, -2)

    def _read(self, rnn: nn.LSTM, embedded: Tensor, mask: Tensor) -> Tensor:
        lengths = mask.sum(-1).clamp_min(1).cpu()  # an all-padding row is masked out downstream
        packed = pack_padded_sequence(self.dropout(embedded), lengths, batch_first=True, enforce_sorted=False)
        states, _ = pad_packed_sequence(rnn(packed)[0], batch_first=True, total_length=embedded.size(1))
        return self.dropout(states)
