"""Bayesian attention inside Hugging Face transformers models, through transformers' own
``AttentionInterface`` (no forked model code): :func:`to_bam` converts a model in place,
:func:`from_pretrained` loads a saved one, gradient checkpointing replays the attention draws, and
:func:`build_sequence_model` makes a Pyro model of a sequence classifier or regressor, and
:class:`BamTrainer` finetunes it with transformers' ``Trainer``. Needs
``transformers`` (``pip install 'bam-pyro[transformers]'``)."""

from ..optional import require

require("transformers", "bam_pyro.transformers")

from .attention import ATTN_IMPLEMENTATION, BAM_ATTRIBUTE, SequenceKeys, bam_attention_forward, register_bam_attention  # noqa: E402
from .convert import from_pretrained, saved_bam_config, to_bam  # noqa: E402
from .sequence import (  # noqa: E402
    DEFAULT_MODEL,
    SequenceClassifier,
    SequenceNetwork,
    SequenceRegressor,
    build_sequence_model,
    count_attention_calls,
    resolve_pretrained,
)
from .trainer import BamTrainer  # noqa: E402

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BAM_ATTRIBUTE",
    "BamTrainer",
    "DEFAULT_MODEL",
    "SequenceClassifier",
    "SequenceKeys",
    "SequenceNetwork",
    "SequenceRegressor",
    "bam_attention_forward",
    "build_sequence_model",
    "count_attention_calls",
    "from_pretrained",
    "register_bam_attention",
    "resolve_pretrained",
    "saved_bam_config",
    "to_bam",
]
