"""transformers' ``Trainer`` on the BAM objective: finetune a :func:`to_bam` model with the ELBO.

``Trainer`` computes a model's own loss from ``model(**inputs)``; a Bayesian attention model's loss
is the ELBO, which needs the Pyro trace around that forward pass (each attention call is a sample
site) and the annealing step ``t`` of ``lambda_t``. :class:`BamTrainer` overrides
``Trainer.compute_loss`` (``compute_loss_func`` only sees the outputs, after the pass) and passes
the Trainer's optimizer step (``state.global_step``, which its checkpoints keep) as ``step=t``. The forward
pass goes through the module the Trainer hands to ``compute_loss``, so accelerate's wrappers (DDP,
FSDP, DeepSpeed, DataParallel) see it and synchronize the gradients as for any model; DDP is told
that every parameter is used (:func:`ddp_arguments`).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from pyro.infer import ELBO
from torch import Tensor, nn
from transformers import Trainer, TrainingArguments

from ..elbo import AttentionMeanFieldELBO
from ..guide import AttentionGuide
from ..model import BamModel
from .sequence import SequenceNetwork

#: batch keys the sequence network reads, in its argument order
SEQUENCE_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class BamTrainer(Trainer):
    """``transformers.Trainer`` whose loss is the ELBO of ``bam_model``, a
    :class:`~bam_pyro.BamModel` of a sequence model (as :func:`build_sequence_model` makes).

    The Trainer trains ``bam_model.network.model``, the transformers model itself (so saving,
    ``push_to_hub`` and checkpoints are transformers'); every other argument is ``Trainer``'s.
    Batches are dicts with ``input_ids``, ``attention_mask``, optional ``token_type_ids`` and
    ``labels``. ``elbo`` defaults to :class:`~bam_pyro.elbo.AttentionMeanFieldELBO` (analytic KL).

    The loss of a batch is the ELBO with ``bam_model``'s reduction: under ``mean`` a per-batch mean
    (``Trainer`` divides it by the gradient accumulation steps), under DDP the mean of the ranks'
    gradients, as for any per-batch loss. Several GPUs visible without ``torchrun`` make ``Trainer``
    wrap the model in ``torch.nn.DataParallel`` (threads): launch with ``torchrun`` instead.
    """

    loss_is_scaled_for_ga = False  # a per-batch loss: Trainer divides it by the accumulation steps

    def __init__(self, bam_model: BamModel, *args: Any, elbo: Optional[ELBO] = None, **kwargs: Any) -> None:
        if not isinstance(bam_model, BamModel) or not isinstance(bam_model.network, SequenceNetwork):
            raise TypeError("bam_model must be a BamModel of a SequenceNetwork (bam_pyro.transformers.build_sequence_model), "
                            f"got {type(bam_model).__name__}")
        if "model" in kwargs or "compute_loss_func" in kwargs:
            raise TypeError("BamTrainer trains bam_model.network.model with the ELBO: pass neither model nor compute_loss_func")
        if args:
            args = (ddp_arguments(args[0]), *args[1:])
        else:  # Trainer's own default when none are given, with DDP's search for unused parameters off
            kwargs["args"] = ddp_arguments(kwargs.get("args") or TrainingArguments(output_dir="tmp_trainer"))
        super().__init__(bam_model.network.model, *args, **kwargs)
        self.bam_model = bam_model
        self.guide = AttentionGuide(bam_model.model)
        self.elbo = AttentionMeanFieldELBO() if elbo is None else elbo

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Optional[Tensor] = None,
    ):
        """The ELBO of one batch at the Trainer's optimizer step (with gradient accumulation, one
        step per accumulated batch), its forward pass through ``model`` (the Trainer's wrapper of the
        transformers model, if any)."""
        if "labels" not in inputs:
            raise KeyError(f"BamTrainer needs 'labels' in every batch; got keys {sorted(inputs)}")
        args = tuple(inputs.get(name) for name in SEQUENCE_INPUTS)
        with forward_through(self.bam_model.network, model):
            loss = self.elbo.differentiable_loss(self.bam_model.model, self.guide, *args, labels=inputs["labels"],
                                                 step=self.state.global_step)
            if not return_outputs:
                return loss
            with torch.no_grad():  # the posterior-mean logits, for evaluation and metrics
                was_training = model.training
                model.eval()
                logits = self.bam_model.network(*args)
                model.train(was_training)
        return loss, {"logits": logits}


def ddp_arguments(args: TrainingArguments) -> TrainingArguments:
    """``args`` with DDP told that every parameter is used (``ddp_find_unused_parameters=False``).

    The KL's gradient reaches the contextual prior networks outside the model's outputs. DDP's
    search for unused parameters starts from those outputs: it would mark the prior networks unused,
    then fail when their gradient arrives ("marked ready twice"). transformers turns the search on
    by default for a model without gradient checkpointing."""
    if args.ddp_find_unused_parameters:
        raise ValueError("ddp_find_unused_parameters must be False or None with BamTrainer: DDP would take the prior "
                         "networks, which the KL alone reaches, for unused parameters")
    return args if args.ddp_find_unused_parameters is False else dataclasses.replace(args, ddp_find_unused_parameters=False)


@contextmanager
def forward_through(network: SequenceNetwork, wrapper: nn.Module) -> Iterator[None]:
    """Within this context ``network`` calls ``wrapper`` (DDP, DataParallel, ... around
    ``network.model``) instead of the bare model, so that the wrapper sees the forward pass."""
    bare = network.model
    if wrapper is bare:
        yield
        return
    network.model = wrapper
    try:
        yield
    finally:
        network.model = bare
