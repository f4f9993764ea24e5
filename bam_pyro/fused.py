"""Fused Bayesian attention: ``softmax(scores + noise) @ V`` without a large attention map in memory.

For dot-product scores both variational families are the scores plus i.i.d. noise in log space
(the constants that do not depend on the key cancel in the normalization):

    Weibull(k):      W = softmax(scores + g / k),      g = log(-log u)
    Lognormal(sigma): W = softmax(scores + sigma * eps), eps ~ N(0, 1)

so attention can run as softmax attention does, block by block. The noise comes from
:mod:`bam_pyro.noise`, a pure function of (seed, batch item, head, query, key), so the backward
pass draws it again instead of keeping it. The function also returns each query's
``logsumexp_j(scores_ij)`` (of the clean scores), with its gradient: the row-wise closed-form KLs
(:mod:`bam_pyro.kl`) need nothing else from the map.

Two routes:

- :func:`chunked_attention` (any device): two custom operators (``torch.library``: the forward
  and the backward, tied by ``register_autograd``) over chunks of queries; ``torch.compile`` calls
  them as they are rather than tracing their loops.
  Forward: per chunk, the scores, the noisy softmax, its product with V and the clean
  log-normalizer. Backward: per chunk, the same scores and noise again, then the gradients of
  Q, K and V as in FlashAttention's backward, plus the clean softmax times the normalizer's
  gradient. Memory: Q, K, V, the output and two numbers per query, plus one chunk of entries.
  Attention dropout is drawn from the same counters (a second stream), so it replays too.
  An eager call whose map is small (at most :data:`STORED_ENTRIES` entries) keeps it instead, as
  soft attention does: one chunk, whose clean softmax, noisy softmax and dropped weights (12
  bytes an entry in float32) the backward pass reads rather than drawing the noise again
  (MiniLM at 16 x 128: the noise chain drawn twice was a quarter of BAM-WC's step, `bench bert
  --profile`). Eagerly each chunk's work after its product of scores runs in place: on CPU a
  fresh map-sized tensor costs more than a pass over it.
  Under ``torch.compile``, a call whose map holds at most :data:`TRACED_ENTRIES` entries is
  instead traced as one chunk of plain tensor operations inside activation checkpointing:
  Inductor fuses the noise, the masks, the softmax and the dropout into its own loops, and the
  backward pass recomputes them rather than keeping the map. On short sequences this beats the
  operators' loop of eager element-wise passes (`bench bert --compile`).
- :func:`flex_attention_route` (CUDA): FlexAttention with a ``score_mod`` that adds the hashed
  noise, forward and backward, and a second call without noise for the clean normalizer. No
  attention dropout (FlexAttention has none); torch 2.13's FlexAttention has no CPU backward, and
  its CUDA kernels need heads of at least 16 dimensions (measured on torch 2.11, H100: 4 fails to
  lower).

:func:`bayesian_dot_attention` picks the route.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import noise
from .pass_context import PassContext

#: entries of one chunk of queries ``[N, H, chunk, Lk]``, about 4 MB in float32
CHUNK_ENTRIES = 2**20


#: largest map (entries of one call) that an eager call keeps for its backward pass instead of drawing
#: the noise again: 48 MB in float32 (the clean and noisy softmax and the dropped weights)
STORED_ENTRIES = 2**22


def _wants_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


#: largest map (entries of one call, ``N * H * Lq * Lk``) that ``torch.compile`` traces as one
#: chunk rather than calling the chunked operators: 16 MB in float32
TRACED_ENTRIES = 2**22


def chunk_size_for(batch_heads: int, num_keys: int, entries: int = CHUNK_ENTRIES) -> int:
    """Queries per chunk so that a chunk holds about ``entries`` attention entries."""
    return max(1, entries // max(1, batch_heads * num_keys))


class _Chunks:
    """What forward and backward share: the inputs' geometry, how to rebuild one chunk's scores,
    validity and noise."""

    def __init__(self, query: Tensor, key: Tensor, row_keys: Tensor, family: str, k: float, sigma: float,
                 key_mask: Optional[Tensor], causal: bool, dropout: float, chunk: int, compiled_noise: bool) -> None:
        self.row_keys, self.family, self.k, self.sigma = row_keys, family, k, sigma
        self.key_mask, self.causal, self.dropout, self.chunk = key_mask, causal, dropout, chunk
        # the dropout's 1 / (1 - p), applied on V's side (the outputs and their gradients: d numbers
        # a row, not Lk); None without dropout; p = 1 keeps nothing, as torch's dropout
        self.keep_scale: Optional[float] = None
        if dropout:
            self.keep_scale = 1.0 / (1.0 - dropout) if dropout < 1.0 else 0.0
        self.draw = _compiled_chunk_noise() if compiled_noise else chunk_noise
        self.num_queries, self.num_keys = query.shape[-2], key.shape[-2]
        self.key_index = noise.counters(0, self.num_keys, query.device)

    def ranges(self):
        return ((start, min(start + self.chunk, self.num_queries)) for start in range(0, self.num_queries, self.chunk))

    def valid(self, start: int, stop: int) -> Optional[Tensor]:
        """Boolean ``[.., chunk or 1, Lk]`` of valid entries, or None if all are."""
        valid = self.key_mask
        if self.causal:
            rows = torch.arange(start, stop, device=self.key_index.device)
            causal = self.key_index <= rows[:, None]
            valid = causal if valid is None else valid & causal
        return valid

    def noisy(self, scores: Tensor, start: int, stop: int) -> tuple[Tensor, Optional[Tensor]]:
        """scores + noise of the chunk, and the dropout keep-mask as 0/1 in the scores' dtype (or None)."""
        rows = noise.counters(start, stop, scores.device)
        drawn, kept = self.draw(self.row_keys, rows, self.key_index, self.family, self.k, self.sigma, self.dropout, scores.dtype)
        return drawn.add_(scores), kept


def chunk_noise(row_keys: Tensor, rows: Tensor, key_index: Tensor, family: str, k: float, sigma: float, dropout: float,
                dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    """The noise ``[N, H, rows, keys]`` of a chunk of queries and its dropout keep-mask, 0/1 in
    ``dtype`` and unscaled (None without dropout): the element-wise chain that
    :func:`compile_noise` hands to Inductor. Each is drawn in the memory of its hashed words."""
    query_keys = noise.query_keys(row_keys, rows)[..., None]
    drawn = noise.log_noise(noise.entry_bits(query_keys, key_index, inplace=True), family, k, sigma, dtype, inplace=True)
    if not dropout:
        return drawn, None
    kept = noise.uniform(noise.entry_bits(query_keys, key_index, noise.DROPOUT_STREAM, inplace=True), dtype, inplace=True)
    return drawn, kept.ge_(dropout)  # 0/1 floats: ATen multiplies floats by bools far slower than by floats


#: whether :func:`compile_noise` asked for the compiled noise in eager calls
_NOISE_COMPILED: PassContext[bool] = PassContext(False)


@functools.cache
def _compiled_chunk_noise() -> Callable[..., tuple[Tensor, Optional[Tensor]]]:
    return torch.compile(chunk_noise, dynamic=True)


@contextmanager
def compile_noise(enabled: bool = True) -> Iterator[None]:
    """Within this context (this thread's), draw the chunked route's noise through ``torch.compile``
    (Inductor fuses the hash, the logarithms and the dropout test into one loop; on CPU about 7x
    faster than the eager ops) or, with ``enabled=False``, eagerly (the default outside: compiling
    takes one to a few minutes the first time in a process, cached on disk after). The compiled
    logarithms may differ from the eager ones in the last bit; forward and backward use the same
    function, so a draw stays one draw (the backward pass needs no context). Under
    ``torch.compile`` of the model the noise is drawn compiled whatever this says (see
    :func:`chunked_attention`)."""
    with _NOISE_COMPILED.entered(enabled):
        yield


def _masked_(values: Tensor, valid: Optional[Tensor]) -> Tensor:
    """``values`` with the invalid entries set to the dtype's lowest number, in place."""
    return values if valid is None else values.masked_fill_(~valid, torch.finfo(values.dtype).min)


def _has_keys(valid: Optional[Tensor]) -> Optional[Tensor]:
    """``[.., chunk or 1, 1]``: rows with at least one valid key (None: all rows have)."""
    return None if valid is None else valid.any(dim=-1, keepdim=True)


def _zero_empty(values: Tensor, has_keys: Optional[Tensor], inplace: bool = False) -> Tensor:
    if has_keys is None:
        return values
    return values.mul_(has_keys) if inplace else values * has_keys


class _ChunkMaps(NamedTuple):
    """One chunk of queries' maps ``[.., rows, Lk]``."""

    #: the clean scores, invalid entries at the dtype's lowest number
    scores: Tensor
    #: the noisy softmax weights before dropout, 0 on rows without keys
    weights: Tensor
    #: the dropout keep-mask, 0/1 unscaled (None without dropout)
    kept: Optional[Tensor]
    #: ``[.., rows, 1]``: rows with at least one valid key (None: all have)
    has_keys: Optional[Tensor]


def _chunk_maps(query_rows: Tensor, key: Tensor, chunks: _Chunks, start: int, stop: int, traced: bool = False) -> _ChunkMaps:
    """The maps of the queries ``start:stop``. Eagerly every step after the scores' product and the
    noise works in place (on CPU a fresh map costs more than a pass over it: its pages are faulted
    in anew); ``traced``: out of place, for autograd to differentiate."""
    scores = query_rows @ key.transpose(-1, -2)
    valid = chunks.valid(start, stop)
    has_keys = _has_keys(valid)
    noisy, kept = chunks.noisy(scores, start, stop)
    noisy = _masked_(noisy, valid)
    if traced or not noisy.is_cpu:
        weights = torch.softmax(noisy, dim=-1)
    else:  # in the noise's memory: ATen's CPU kernel reads each row before it writes it
        weights = torch.ops.aten._softmax.out(noisy, -1, False, out=noisy)
    return _ChunkMaps(_masked_(scores, valid), _zero_empty(weights, has_keys, inplace=not traced), kept, has_keys)


def _clean_normalizer_(scores: Tensor, has_keys: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``logsumexp`` over the keys of masked clean scores, computed over them: ``exp(scores - max)``
    written over the scores, its row sums ``[.., rows, 1]`` and the log-normalizer ``[.., rows]`` (0
    on rows without keys). The clean softmax is the first over the second."""
    peak = scores.amax(dim=-1, keepdim=True)  # finite: masked entries are the lowest number, not -inf
    exps = scores.sub_(peak).exp_()
    total = exps.sum(dim=-1, keepdim=True)
    return exps, total, _zero_empty(peak + total.log(), has_keys).squeeze(-1)


def _forward(query: Tensor, key: Tensor, value: Tensor, chunks: _Chunks, traced: bool = False) -> tuple[Tensor, Tensor]:
    """(Q, K, V) -> (softmax(QK^T + noise) @ V, logsumexp(QK^T)) chunk by chunk. ``traced``: for
    autograd to differentiate (nothing is overwritten, see :func:`_chunk_maps`)."""
    outputs, normalizers = [], []
    for start, stop in chunks.ranges():
        maps = _chunk_maps(query[..., start:stop, :], key, chunks, start, stop, traced)
        outputs.append(_output(_dropped(maps, traced), value, chunks.keep_scale))
        if traced:
            normalizers.append(_zero_empty(torch.logsumexp(maps.scores, dim=-1, keepdim=True), maps.has_keys).squeeze(-1))
        else:
            normalizers.append(_clean_normalizer_(maps.scores, maps.has_keys)[2])
    return torch.cat(outputs, dim=-2), torch.cat(normalizers, dim=-1)


def _dropped(maps: _ChunkMaps, traced: bool = False) -> Tensor:
    """The dropped weights, unscaled (the keep-mask overwritten unless ``traced``)."""
    if maps.kept is None:
        return maps.weights
    return maps.weights * maps.kept if traced else maps.kept.mul_(maps.weights)


def _output(dropped: Tensor, value: Tensor, keep_scale: Optional[float]) -> Tensor:
    """The attention output of the dropped weights, scaled by the dropout's ``1 / (1 - p)``."""
    out = dropped @ value
    return out if keep_scale is None else out.mul_(keep_scale)  # a product's output: autograd needs it not


def _zero_key_value_grads(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Zeroed gradients of K and V, over the batch shape they broadcast to with Q, for the chunks
    to add to."""
    grad_key = torch.zeros(torch.broadcast_shapes(key.shape[:-2], query.shape[:-2]) + key.shape[-2:],
                           dtype=key.dtype, device=key.device)
    return grad_key, torch.zeros(grad_key.shape[:-1] + value.shape[-1:], dtype=value.dtype, device=value.device)


def _chunk_grads(grad_out: Tensor, grad_lse: Tensor, query_rows: Tensor, key: Tensor, value: Tensor, clean: Tensor,
                 weights: Tensor, dropped: Tensor, keep_scale: Optional[float], grad_key: Tensor, grad_value: Tensor
                 ) -> Tensor:
    """One chunk's gradient of Q (returned); its gradients of K and V are added to ``grad_key`` and
    ``grad_value``. ``clean``: the clean softmax; ``weights``: the noisy one; ``dropped``: the
    weights after dropout, unscaled; ``keep_scale``: the dropout's ``1 / (1 - p)`` (None without).
    Reads the maps, writes none of them.

    With ``D = keep_scale * dropped`` and ``G = grad_out @ V^T``, the weights' gradient is
    ``keep_scale * mask * G`` and the softmax backward gives the scores' ``D * G - W * rowsum(D * G)``:
    the mask itself is not needed."""
    if keep_scale is not None:
        grad_out = grad_out * keep_scale
    grad_value += dropped.transpose(-1, -2) @ grad_out
    grad_scores = (grad_out @ value.transpose(-1, -2)).mul_(dropped)
    grad_scores.addcmul_(weights, grad_scores.sum(dim=-1, keepdim=True), value=-1.0)
    grad_scores.addcmul_(clean, grad_lse[..., None])  # the normalizer's gradient
    grad_key += grad_scores.transpose(-1, -2) @ query_rows
    return grad_scores @ key


def _backward(grad_out: Tensor, grad_lse: Tensor, query: Tensor, key: Tensor, value: Tensor, lse: Tensor,
              chunks: _Chunks) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of Q, K and V (contiguous), chunk by chunk, the scores and the noise regenerated."""
    grad_query = query.new_empty(query.shape)
    grad_key, grad_value = _zero_key_value_grads(query, key, value)
    for start, stop in chunks.ranges():
        rows = query[..., start:stop, :]
        maps = _chunk_maps(rows, key, chunks, start, stop)
        # exp(scores - lse): 0 on rows without keys, whose normalizer is 0
        clean = maps.scores.sub_(lse[..., start:stop, None]).exp_()
        grad_query[..., start:stop, :] = _chunk_grads(
            grad_out[..., start:stop, :], grad_lse[..., start:stop], rows, key, value, clean, maps.weights,
            _dropped(maps), chunks.keep_scale, grad_key, grad_value)
    return grad_query, grad_key.sum_to_size(key.shape), grad_value.sum_to_size(value.shape)


class _StoredMapAttention(torch.autograd.Function):
    """The chunked function's forward and backward as one chunk that keeps its maps for the backward
    pass (the clean softmax, the noisy one and the dropped weights: 12 bytes an entry in float32)
    instead of drawing the noise again: for maps of at most :data:`STORED_ENTRIES` entries in eager
    mode, where regenerating the noise cost more than keeping it (module doc)."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, chunks: _Chunks) -> tuple[Tensor, Tensor]:
        maps = _chunk_maps(query, key, chunks, 0, chunks.num_queries)
        dropped = _dropped(maps)
        out = _output(dropped, value, chunks.keep_scale)
        exps, total, lse = _clean_normalizer_(maps.scores, maps.has_keys)
        clean = _zero_empty(exps.div_(total), maps.has_keys, inplace=True)
        ctx.save_for_backward(query, key, value, clean, maps.weights, dropped)
        ctx.keep_scale = chunks.keep_scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lse: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        query, key, value, clean, weights, dropped = ctx.saved_tensors
        grad_key, grad_value = _zero_key_value_grads(query, key, value)
        grad_query = _chunk_grads(grad_out, grad_lse, query, key, value, clean, weights, dropped, ctx.keep_scale,
                                  grad_key, grad_value)
        return grad_query, grad_key.sum_to_size(key.shape), grad_value.sum_to_size(value.shape), None


# The chunked function is a pair of custom operators with their own autograd: torch.compile calls
# them as they are instead of tracing the loops, whose intermediates Inductor would keep for the
# backward (`bench bert --compile`, MiniLM 16 x 128: BAM-WC's peak 1199 MB traced, 883 MB opaque,
# compiled soft 912 MB).


@torch.library.custom_op("bam_pyro::chunked_attention", mutates_args=())
def _chunked_attention_op(query: Tensor, key: Tensor, value: Tensor, row_keys: Tensor, key_mask: Optional[Tensor],
                          family: str, k: float, sigma: float, causal: bool, dropout: float, chunk: int,
                          compiled_noise: bool) -> tuple[Tensor, Tensor]:
    chunks = _Chunks(query, key, row_keys, family, k, sigma, key_mask, causal, dropout, chunk, compiled_noise)
    return _forward(query, key, value, chunks)


@_chunked_attention_op.register_fake
def _(query, key, value, row_keys, key_mask, family, k, sigma, causal, dropout, chunk, compiled_noise):
    batch = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    num_queries = query.shape[-2]
    return query.new_empty(batch + (num_queries, value.shape[-1])), query.new_empty(batch + (num_queries,))


@torch.library.custom_op("bam_pyro::chunked_attention_backward", mutates_args=())
def _chunked_attention_backward_op(grad_out: Tensor, grad_lse: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                   lse: Tensor, row_keys: Tensor, key_mask: Optional[Tensor], family: str, k: float,
                                   sigma: float, causal: bool, dropout: float, chunk: int,
                                   compiled_noise: bool) -> tuple[Tensor, Tensor, Tensor]:
    chunks = _Chunks(query, key, row_keys, family, k, sigma, key_mask, causal, dropout, chunk, compiled_noise)
    return _backward(grad_out, grad_lse, query, key, value, lse, chunks)


@_chunked_attention_backward_op.register_fake
def _(grad_out, grad_lse, query, key, value, lse, row_keys, key_mask, family, k, sigma, causal, dropout, chunk,
      compiled_noise):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)  # contiguous, as the real ones


def _save_for_backward(ctx, inputs, output) -> None:
    query, key, value, row_keys, key_mask, *ctx.settings = inputs
    ctx.save_for_backward(query, key, value, output[1], row_keys, key_mask)


def _chunked_attention_grad(ctx, grad_out: Tensor, grad_lse: Tensor):
    query, key, value, lse, row_keys, key_mask = ctx.saved_tensors
    grads = _chunked_attention_backward_op(grad_out, grad_lse, query, key, value, lse, row_keys, key_mask, *ctx.settings)
    return (*grads, None, None, None, None, None, None, None, None, None)


_chunked_attention_op.register_autograd(_chunked_attention_grad, setup_context=_save_for_backward)


def chunked_attention(query: Tensor, key: Tensor, value: Tensor, row_keys: Tensor, family: str, *, k: float = 1.0,
                      sigma: float = 1.0, key_mask: Optional[Tensor] = None, causal: bool = False,
                      dropout: float = 0.0, chunk: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Bayesian dot-product attention by chunks of queries (see the module doc).

    ``query`` ``[N, H, Lq, d]`` (already scaled), ``key``/``value`` ``[N, H, Lk, d]``;
    ``row_keys`` ``[N, H]`` int32 from :func:`bam_pyro.noise.row_keys`; ``key_mask``: boolean
    ``[N or 1, H or 1, 1, Lk]``, True = valid key; ``causal``: query i sees keys j <= i (top-left
    aligned, as ``scaled_dot_product_attention``'s ``is_causal``). Returns the output
    ``[N, H, Lq, dv]`` and the clean log-normalizer ``[N, H, Lq]`` (0 for queries without keys,
    whose output is 0). ``chunk``: queries per chunk, each chunk's map regenerated in the backward
    pass; None: an eager call that wants a gradient keeps a map of at most :data:`STORED_ENTRIES`
    entries, a larger one goes by chunks of about :data:`CHUNK_ENTRIES` entries."""
    if key_mask is not None and key_mask.shape[-2] != 1:
        raise ValueError(f"key_mask must be a key padding mask [..., 1, Lk], got shape {tuple(key_mask.shape)}")
    entries = query.shape[:-1].numel() * key.shape[-2]
    settings = (row_keys, family, float(k), float(sigma), key_mask, causal, float(dropout))
    if torch.compiler.is_compiling() and entries <= TRACED_ENTRIES:
        # small enough to trace: Inductor fuses the element-wise chain, recomputed in the backward (module doc)
        chunks = _Chunks(query, key, *settings, query.shape[-2], compiled_noise=False)
        return checkpoint(_forward, query, key, value, chunks, traced=True, use_reentrant=False)
    # a larger call under torch.compile: the operators stay opaque, their noise drawn by Inductor. The
    # choice travels with the call, so that its backward draws the same noise
    compiled_noise = _NOISE_COMPILED.current() or torch.compiler.is_compiling()
    if chunk is None and entries <= STORED_ENTRIES and not torch.compiler.is_compiling() and _wants_grad(query, key, value):
        chunks = _Chunks(query, key, *settings, query.shape[-2], compiled_noise)
        return _StoredMapAttention.apply(query, key, value, chunks)
    if chunk is None:
        chunk = chunk_size_for(query.shape[:-2].numel(), key.shape[-2])
    return _chunked_attention_op(query, key, value, row_keys, key_mask, family, float(k), float(sigma), causal,
                                 float(dropout), chunk, compiled_noise)


def noise_score_mod(row_keys: Tensor, num_queries: int, family: str, k: float, sigma: float) -> Callable[..., Tensor]:
    """FlexAttention ``score_mod`` that adds the counter-based noise of (batch item, head, query,
    key) to each score: the chunked route's draw, entry by entry. ``k`` and ``sigma`` travel as
    0-d tensors: as Python floats, a second value would recompile FlexAttention with a symbolic
    float, which Inductor fails to lower."""
    rows = noise.query_keys(row_keys, noise.counters(0, num_queries, row_keys.device))  # [N, H, Lq]
    shape, scale = (torch.tensor(v, dtype=torch.float32, device=row_keys.device) for v in (k, sigma))

    def add_noise(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        bits = noise.entry_bits(rows[b, h, q_idx], kv_idx)
        return score + noise.log_noise(bits, family, shape, scale, score.dtype)

    return add_noise


@functools.cache
def _compiled_flex_attention() -> Callable[..., Any]:
    """FlexAttention compiled once per process: uncompiled, it runs a reference implementation
    that materializes the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_attention_route(query: Tensor, key: Tensor, value: Tensor, row_keys: Tensor, family: str, *, k: float = 1.0,
                         sigma: float = 1.0, key_mask: Optional[Tensor] = None, causal: bool = False) -> tuple[Tensor, Tensor]:
    """The same as :func:`chunked_attention` (without dropout) through FlexAttention, for CUDA:
    one call adds the hashed noise in a ``score_mod`` (forward and backward regenerate it), a
    second one without noise gives the clean log-normalizer and its gradient. FlexAttention is
    compiled (once per process): uncompiled it would materialize the scores."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    attend = _compiled_flex_attention()
    batch, heads, num_queries, num_keys = query.shape[0], query.shape[1], query.shape[-2], key.shape[-2]
    add_noise = noise_score_mod(row_keys, num_queries, family, k, sigma)

    block_mask = None
    if key_mask is not None or causal:
        padding = None if key_mask is None else key_mask.expand(batch, heads, 1, num_keys)[:, :, 0, :]

        def valid(b, h, q_idx, kv_idx):
            keep = (kv_idx <= q_idx) if causal else (kv_idx >= 0)
            return keep if padding is None else keep & padding[b, h, kv_idx]

        block_mask = create_block_mask(valid, batch, heads, num_queries, num_keys, device=query.device)
    out = attend(query, key, value, score_mod=add_noise, block_mask=block_mask, scale=1.0)
    _, aux = attend(query, key, value, block_mask=block_mask, scale=1.0, return_aux=AuxRequest(lse=True))
    lse = aux.lse
    if key_mask is not None or causal:  # rows without keys: output 0 (FlexAttention's), normalizer 0
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return out, lse


#: the smallest head (query/key and value dimensions) FlexAttention's kernels take
FLEX_MIN_HEAD_DIM = 16


def flex_attention_fits(query: Tensor, value: Tensor, dropout: float) -> bool:
    """Whether :func:`flex_attention_route` can take the call: CUDA, no attention dropout, and heads
    of at least :data:`FLEX_MIN_HEAD_DIM` dimensions."""
    return query.is_cuda and not dropout and min(query.shape[-1], value.shape[-1]) >= FLEX_MIN_HEAD_DIM


def bayesian_dot_attention(query: Tensor, key: Tensor, value: Tensor, row_keys: Tensor, family: str, *,
                           k: float = 1.0, sigma: float = 1.0, key_mask: Optional[Tensor] = None,
                           causal: bool = False, dropout: float = 0.0) -> tuple[Tensor, Tensor]:
    """FlexAttention where it fits (:func:`flex_attention_fits`), the chunked function otherwise
    (same arguments)."""
    if flex_attention_fits(query, value, dropout):
        return flex_attention_route(query, key, value, row_keys, family, k=k, sigma=sigma, key_mask=key_mask, causal=causal)
    return chunked_attention(query, key, value, row_keys, family, k=k, sigma=sigma, key_mask=key_mask,
                             causal=causal, dropout=dropout)

