"""Bayesian attention inside pretrained transformers, by configuration (no forked model code).

transformers routes every attention call, self- and cross-attention, through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. :func:`to_bam` registers
:func:`bam_attention_forward` under the name ``"bam"``, attaches a :class:`~bam_pyro.BayesianAttention`
(``bam_attention``), sized by the module's own heads, to every module that calls that interface
(:func:`calls_attention_interface`), and switches the model to it. The variational distribution
reuses the pretrained query/key projections (Phi = log softmax of the scores of the model's
eager attention: scaled dot products, soft-capped where the model does, plus T5's relative
position bias); the contextual prior network is new, randomly initialized, a registered submodule (so it trains and is saved
with the model). Each call of an attention module is its own Pyro sample site: ALBERT's shared
layer, called 12 times, gives ``...bam_attention``, ``...bam_attention#2`` ... ``#12``, each with its own KL.

Padding: masked keys get zero weight and, with padded queries, zero KL (see :class:`SequenceKeys`).
Causal models (Llama-style, grouped-query attention included) get their causal mask always
built (:func:`bam_mask`).
In eval mode the attention is the posterior mean, which equals the pretrained softmax attention.

The usual transformers calls keep working: ``save_pretrained`` saves the prior networks and the
:class:`~bam_pyro.BamConfig` (in ``config.bam``), :func:`from_pretrained` loads both back, and
``gradient_checkpointing_enable`` gives the gradients of the uncheckpointed model
(:mod:`bam_pyro.transformers.checkpointing`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from typing import Any, Optional

import transformers
from torch import nn
from transformers import AutoConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from ..attention import BayesianAttention
from ..config import BamConfig
from .attention import ATTN_IMPLEMENTATION, BAM_ATTRIBUTE, register_bam_attention
from .checkpointing import replay_bayesian_checkpoints

#: where attention modules keep their number of heads and head size (BERT/ALBERT, Bart/Whisper,
#: T5, Llama-style); the module's own attributes come before its config's, which for an
#: encoder-decoder holds one side's head count only
HEAD_COUNT_NAMES = ("num_attention_heads", "num_heads", "n_heads")
HEAD_SIZE_NAMES = ("attention_head_size", "head_dim", "key_value_proj_dim")
#: the registry of attention functions that transformers' attention modules call through
ATTENTION_FUNCTIONS = "ALL_ATTENTION_FUNCTIONS"


def _first_int(owner: Any, names: tuple[str, ...]) -> Optional[int]:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def calls_attention_interface(module: nn.Module) -> bool:
    """Whether the module's ``forward`` looks its attention function up in transformers'
    ``ALL_ATTENTION_FUNCTIONS`` (read from the names its code refers to, not by running it): how
    every attention module of transformers dispatches on ``attn_implementation``, whatever else
    it carries (BERT's ``scaling`` attribute, or ModernBERT's scaling passed as an argument)."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and ATTENTION_FUNCTIONS in code.co_names


def _head_geometry(module: nn.Module) -> Optional[tuple[int, int]]:
    """(heads, head_size) of a module that calls the attention interface, else None. Such modules
    carry their head layout (on themselves, or the head count on their config)."""
    if not calls_attention_interface(module):
        return None
    heads = _first_int(module, HEAD_COUNT_NAMES) or _first_int(getattr(module, "config", None), ("num_attention_heads",))
    head_size = _first_int(module, HEAD_SIZE_NAMES)
    return (heads, head_size) if heads and head_size else None


def attach_bayesian_attention(model: PreTrainedModel, config: BamConfig) -> None:
    """Give every attention module of ``model`` a :class:`~bam_pyro.BayesianAttention`, make its
    checkpointed layers replay them (:mod:`bam_pyro.transformers.checkpointing`) and record
    ``config`` in ``model.config.bam`` (saved with the model; :func:`from_pretrained` reads it)."""
    found = 0
    for module in model.modules():
        geometry = _head_geometry(module)
        if geometry is not None:
            attention = BayesianAttention(config, *geometry).train(module.training)  # the model's mode, kept
            weight = next(module.parameters(), None)  # a model already on its device gets its priors there
            setattr(module, BAM_ATTRIBUTE, attention if weight is None else attention.to(weight.device))
            found += 1
    if not found:
        raise ValueError(f"found no attention module in {type(model).__name__} (none calls transformers' attention "
                         "interface, ALL_ATTENTION_FUNCTIONS, and has a head layout)")
    for layer in model.modules():  # a model is converted once (to_bam refuses a second time), so is each layer hooked
        if isinstance(layer, GradientCheckpointingLayer) and any(isinstance(m, BayesianAttention) for m in layer.modules()):
            layer.register_forward_pre_hook(replay_bayesian_checkpoints)
    model.config.bam = dataclasses.asdict(config)


def lost_priors_error() -> ValueError:
    """The error for a saved BAM model loaded by transformers' own from_pretrained: its config says
    BAM, its trained priors are gone."""
    return ValueError(
        "the model's config records Bayesian attention but the model has none (loaded with transformers' "
        "from_pretrained, which drops its trained priors): load it with bam_pyro.transformers.from_pretrained"
    )


def to_bam(model: PreTrainedModel, config: BamConfig) -> PreTrainedModel:
    """Turn every attention module of ``model`` into Bayesian attention, in place, and return it.

    ``variant="soft"`` is allowed (plain softmax through the same code path), which is useful to
    check the integration; for soft finetuning leave the model unconverted. The model keeps its
    mode: one in eval mode (as ``from_pretrained`` returns it) predicts with the posterior mean,
    one in training mode samples. ``save_pretrained``
    then saves the prior networks and ``config``; :func:`from_pretrained` loads the model back.
    """
    if getattr(model.config, "bam", None) is not None:
        if any(isinstance(m, BayesianAttention) for m in model.modules()):
            raise ValueError("the model already has Bayesian attention: convert a model once")
        raise lost_priors_error()
    register_bam_attention()
    attach_bayesian_attention(model, config)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


#: keyword arguments of ``from_pretrained`` that say where and how to fetch files
DOWNLOAD_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token", "trust_remote_code")


def download_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords of ``kwargs`` that say where and how to fetch files, for ``AutoConfig``."""
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
    config = AutoConfig.from_pretrained(pretrained, **download_arguments(kwargs))
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
        # private: transformers has no public lookup of an auto class's model class (tests/test_private_names.py)
        model_class = model_class._model_mapping[type(config)]
    model = _loading_class(model_class).from_pretrained(pretrained, attn_implementation=ATTN_IMPLEMENTATION, **kwargs)
    model.__class__ = model_class  # the loading subclass only served the construction
    return model
