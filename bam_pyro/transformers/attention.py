"""Bayesian attention as a transformers attention function: ``attn_implementation="bam"``.

transformers routes every attention call, self- and cross-attention, through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``; :func:`register_bam_attention` adds
:func:`bam_attention_forward` there under the name ``"bam"``, with :func:`bam_mask` as its mask.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import (AttentionMaskInterface, bidirectional_mask_function, causal_mask_function,
                                        sdpa_mask)
from transformers.utils.output_capturing import _active_collector

from ..axes import DenseKeys
from ..tensor_memo import LastTensorsMemo
from .checkpointing import active_replay
from .folding import SampleFold, active_fold

#: the ``attn_implementation`` name of Bayesian attention
ATTN_IMPLEMENTATION = "bam"
#: attribute of an attention module that holds its Bayesian attention
BAM_ATTRIBUTE = "bam_attention"
#: attribute of a mask :func:`bam_mask` built, naming its kind: key padding or causal with key padding
MASK_KIND = "bam_mask_kind"
KEY_PADDING, CAUSAL = "key padding", "causal"


class SequenceKeys(DenseKeys):
    """Attention entries ``[B, H, Lq, Lk]`` of a batch of sequences, as transformers lays them out.

    ``mask``: transformers' boolean mask ``[B, 1, Lq, Lk]`` (True = attend) or None. A square mask
    whose rows are all equal is key padding: the weights then normalize over the valid keys
    (``key_mask`` ``[B, 1, 1, Lk]``) and per-key values (the prior's Psi) stay ``[B, H, 1, Lk]``
    instead of growing to full maps. In self-attention (``queries_are_keys``: queries and keys
    are the same positions) the site mask (KL, entry count) also drops the rows of padded queries;
    in cross-attention the queries are other positions (a decoder's), which the keys' padding
    says nothing of. Any other mask (causal, custom) is used as is.

    The batch is part of one site's event (``event_dim = 4``): transformers' modules cannot run
    inside a data plate with extra sample dimensions, and the KL of a batch is the sum over its
    sequences either way.
    """

    event_dim = 4

    def __init__(self, mask: Optional[Tensor], batch_size: int, queries_are_keys: bool = True) -> None:
        if mask is not None and mask.dtype != torch.bool:
            raise TypeError(
                f"Bayesian attention expects a boolean attention mask (True = attend), got {mask.dtype}; "
                f"convert the model with to_bam() so that the '{ATTN_IMPLEMENTATION}' mask function is used"
            )
        query_mask = None
        if mask is not None and mask.shape[-1] == mask.shape[-2]:
            first_row = mask[..., :1, :]
            if is_key_padding(mask, first_row):
                mask = first_row
                if queries_are_keys:  # the padded positions are queries too
                    query_mask = first_row.transpose(-1, -2)
        super().__init__(mask, batch_shape=torch.Size([batch_size]), query_mask=query_mask)


#: keys of transformers' output capturing that collect attention maps
CAPTURED_MAPS = ("attentions", "cross_attentions")
#: keyword arguments of transformers' attention functions that change how scores become weights in
#: ways Bayesian attention does not implement: refused rather than ignored
UNSUPPORTED_ARGUMENTS = {"s_aux": "attention sinks", "sinks": "attention sinks", "sink_scale": "attention sinks"}


def bam_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    position_bias: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """transformers attention function: query ``[B, H, L, d]``, key/value ``[B, H or fewer, L, d]``
    -> output ``[B, L, H, d]`` and weights ``[B, H, Lq, Lk]``, with the weights drawn by the
    module's Bayesian attention. The weights returned (``output_attentions=True``) are the
    Bayesian weights themselves, before the attention dropout that the output sees.

    The scores before Phi are those of the model's eager attention: the scaled dot products, soft-
    capped (Gemma 2's ``softcap``), plus an additive ``position_bias`` (T5's relative positions;
    ``[B or 1, H, Lq, Lk]``).

    Without soft-capping or a position bias, with a mask :func:`fused_layout` reads (none, key
    padding, causal), and unless the caller asks for the maps (``output_attentions=True``), the call
    takes the fused path (:meth:`~bam_pyro.BayesianAttention.attend`): no attention map in memory,
    attention dropout drawn from the noise's counters, and None for the weights, as transformers'
    ``sdpa`` returns; ``bam_pyro.attention.set_fused(model, False)`` keeps the materialized path and
    its weights for every call.
    """
    bam = getattr(module, BAM_ATTRIBUTE, None)
    if bam is None:
        raise RuntimeError(
            f"{type(module).__name__} has no Bayesian attention; convert the model with to_bam() "
            f"instead of setting attn_implementation='{ATTN_IMPLEMENTATION}' alone"
        )
    for name, feature in UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{type(module).__name__} passes {name}= ({feature}), which Bayesian attention does not implement")
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    queries_are_keys = not getattr(module, "is_decoder", False)
    layout = fused_layout(attention_mask, query.size(-2), key.size(-2), queries_are_keys)
    fold = active_fold()
    if fold is not None:  # draws folded into the batch (folding.py): sample dims ahead of [B, H, L, d] from here on
        query, key, value = fold.unfold(query), fold.unfold(key), fold.unfold(value)
        attention_mask, position_bias = fold.first_draw(attention_mask), fold.first_draw(position_bias)
        if layout is not None:
            layout = FusedLayout(fold.first_draw(layout.key_mask), fold.first_draw(layout.query_mask), layout.causal)
    if key.size(-3) != query.size(-3):  # grouped-query attention: each key/value head serves a group of query heads
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    keys = key.transpose(-3, -2)
    replay = active_replay() if bam.config.stochastic else None
    wants_weights = maps_requested(kwargs)
    if softcap is None and position_bias is None and layout is not None and not wants_weights and bam.uses_fused_path():
        # the fused path: no attention map; the weights are not returned (as with sdpa)
        def attend() -> Tensor:
            return bam.attend(query * scaling, key, value, keys=keys, key_mask=layout.key_mask,
                              query_mask=layout.query_mask, causal=layout.causal,
                              dropout=dropout if module.training else 0.0)

        output = attend() if replay is None else replay.attend(attend, query, query.shape[:-1] + value.shape[-1:])
        return _refolded(fold, output.transpose(-3, -2).contiguous()), None
    scores = torch.matmul(query * scaling, key.transpose(-1, -2))  # scaled before: 4x fewer entries
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias
    # cross-attention modules are decoder modules; a decoder's self-attention is causal, never key padding
    axis = SequenceKeys(attention_mask, query.size(-4), queries_are_keys=queries_are_keys)
    if replay is None:
        weights = bam(scores, keys, axis)
    else:  # inside a checkpointed layer: drawn once, replayed by the recomputation
        weights = replay.attend(lambda: bam(scores, keys, axis), scores, scores.shape)
    output = torch.matmul(F.dropout(weights, p=dropout, training=module.training), value)
    return _refolded(fold, output.transpose(-3, -2).contiguous()), _refolded(fold, weights)


def _refolded(fold: Optional[SampleFold], value: Tensor) -> Tensor:
    """``value`` back in transformers' ``[draws * B, ...]`` layout if the draws were unfolded."""
    return value if fold is None else value.flatten(0, len(fold.sample_shape))


def maps_requested(kwargs: dict[str, Any]) -> bool:
    """Whether the caller asks for the attention maps: ``output_attentions=True`` passed down to the
    attention function (BERT), or transformers' output capturing collecting them (GPT-2's forward
    takes the flag off before its attention modules run; its ``capture_outputs`` hooks then record
    what each module returns)."""
    if kwargs.get("output_attentions"):
        return True
    collecting = _active_collector.get()  # private: no public view of what the capture collects (tests/test_private_names.py)
    return bool(collecting) and any(key in collecting for key in CAPTURED_MAPS)


class FusedLayout(NamedTuple):
    """A transformers mask in the fused path's terms: key padding ``[B, 1, 1, Lk]``, the valid
    queries of the site ``[B, 1, Lq, 1]`` (or None) and causality."""

    key_mask: Optional[Tensor]
    query_mask: Optional[Tensor]
    causal: bool


def fused_layout(mask: Optional[Tensor], num_queries: int, num_keys: int, queries_are_keys: bool) -> Optional[FusedLayout]:
    """The layout of a transformers boolean mask ``[B, 1, Lq, Lk]`` if the fused path can run it: no
    mask, key padding (every row alike; the padded positions are queries too where
    ``queries_are_keys``, as in :class:`SequenceKeys`), or causal with key padding (``Lq == Lk``).
    None for any other mask (sliding windows, caches, custom masks): the materialized path runs it.
    Telling them apart reads the mask on the host; transformers passes one mask to every layer of
    a forward pass, so the layout of the last mask read is kept while that tensor lives and is
    not written to (:class:`~bam_pyro.tensor_memo.LastTensorsMemo`): one read per forward pass,
    not one per layer. A mask :func:`bam_mask` built says its kind itself: no read."""
    if mask is None:
        return FusedLayout(None, None, False)
    if torch.compiler.is_compiling():
        return _read_layout(mask, num_queries, num_keys, queries_are_keys)
    kind = getattr(mask, MASK_KIND, None)
    if kind == KEY_PADDING and mask.shape[-1] == num_keys:
        key_mask = mask[..., :1, :]
        return FusedLayout(key_mask, key_mask.transpose(-1, -2) if queries_are_keys and num_queries == num_keys else None, False)
    if kind == CAUSAL and mask.shape[-1] == num_keys == num_queries:
        return FusedLayout(mask[..., -1:, :], None, True)
    return _LAST_LAYOUT.get(lambda: _read_layout(mask, num_queries, num_keys, queries_are_keys), mask,
                            key=(num_queries, num_keys, queries_are_keys))


#: the layout of the last mask read, for the same sizes. Process-wide and safe so: a hit needs that
#: very tensor, unwritten since, whose layout is the same in any pass or thread
_LAST_LAYOUT: LastTensorsMemo[Optional[FusedLayout]] = LastTensorsMemo()


def _read_layout(mask: Tensor, num_queries: int, num_keys: int, queries_are_keys: bool) -> Optional[FusedLayout]:
    """:func:`fused_layout` read from the mask itself. The rows it keeps are copies: views would
    keep the whole mask alive in :data:`_LAST_LAYOUT`."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != num_keys:
        return None
    first_row = mask[..., :1, :].clone()
    if bool((mask == first_row).all()):
        query_mask = first_row.transpose(-1, -2) if queries_are_keys and num_queries == num_keys else None
        return FusedLayout(first_row, query_mask, False)
    if num_queries != num_keys:
        return None
    last_row = mask[..., -1:, :].clone()  # under a causal mask the last query sees every valid key
    causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=mask.device).tril()
    if bool((mask == (causal & last_row)).all()):
        return FusedLayout(last_row, None, True)
    return None


def is_key_padding(mask: Tensor, first_row: Tensor) -> bool:
    """Whether a square mask ``[B, 1, L, L]`` is key padding (every row alike): its kind if
    :func:`bam_mask` built it, else read from its values on the host."""
    kind = None if torch.compiler.is_compiling() else getattr(mask, MASK_KIND, None)
    if kind is not None:
        return kind == KEY_PADDING
    return bool((mask == first_row).all())


def bam_mask(*args: Any, **kwargs: Any) -> Optional[Tensor]:
    """transformers' sdpa mask (boolean, True = attend), built for causal attention: sdpa may return
    None for a causal mask without padding and leave causality to its kernel's ``is_causal``;
    Bayesian attention reads None as "every key is valid", so the model would look ahead. For
    bidirectional attention without padding None is right, and sdpa gives it (one look at the 2D
    padding mask on the host, once a forward pass; not in a traced graph, nor on the meta
    device): the attention calls then mask no chunk of scores (on a padding-free MiniLM batch of
    16 x 128, 2% of BAM-WC's training step, record ``results/bench/bert/minilm-16x128-profile.json``).

    A mask of transformers' plain bidirectional or causal function (no offset, no window, no
    packed sequences) is marked with its kind (:data:`MASK_KIND`), so that the attention calls of
    the pass need not read its values to tell key padding and causal masks from others."""
    function, padding = kwargs.get("mask_function"), kwargs.get("attention_mask")
    readable = padding is None or padding.device.type != "meta"  # a meta tensor has no values to look at
    mask = sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False,
                               "allow_is_bidirectional_skip": function is bidirectional_mask_function and readable})
    plain = not args and not kwargs.get("q_offset") and not kwargs.get("kv_offset") and kwargs.get("local_size") is None
    if mask is not None and plain and function in (bidirectional_mask_function, causal_mask_function) \
            and not torch.compiler.is_compiling():
        setattr(mask, MASK_KIND, KEY_PADDING if function is bidirectional_mask_function else CAUSAL)
    return mask


def register_bam_attention() -> None:
    """Make ``attn_implementation="bam"`` known to transformers (idempotent), with :func:`bam_mask`
    as its mask function."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, bam_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, bam_mask)
