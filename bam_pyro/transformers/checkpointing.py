"""Activation checkpointing of layers with Bayesian attention: each attention sample is drawn once.

Checkpointing runs a layer's forward pass, drops what autograd saved inside it, and runs the
forward again during the backward pass to get those tensors back. Bayesian attention does not fit
that contract as is: its call is a Pyro sample site, so its prior, its guide and its value leave
the layer through the Pyro trace (where the ELBO reads their KL) rather than through the layer's
outputs, and the recomputation runs in the backward pass, outside the model, where no site can
be declared and a new draw would differ from the one the loss used.

Here a checkpointed layer (:class:`AttentionReplay`) keeps what its Bayesian attention calls
computed in the forward pass instead of dropping it, and the recomputation replays those calls:

- forward pass: each call runs as usual (one Pyro site, sampled by the guide), with autograd
  keeping its tensors (saved-tensor hooks that keep tensors as they are override the
  checkpoint's). They are Phi, the prior's parameters and the sample S, which the Pyro trace
  holds until the loss is computed anyway, the normalized weights and the prior network's input.
  The call's weights and the random-number state after it are recorded;
- recomputation: each call returns its recorded weights and moves the random-number generator to
  where the forward pass left it, so that the dropout masks drawn after it are the forward
  pass's too. No site is declared and no noise is drawn.

On the fused path (:mod:`bam_pyro.fused`) a call keeps its queries, keys and values instead of a
map, and what is replayed is its output; the noise needs no record: the fused backward pass
regenerates it from the seed the site drew.

Everything else in the layer is recomputed as usual, and the gradients are those of the
uncheckpointed model. This needs checkpointing without reentrant autograd: reentrant
checkpointing runs the forward pass under ``torch.no_grad()``, so the KL read from the trace
would have no gradient; :class:`BamCheckpoint` therefore checkpoints non-reentrantly.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..pass_context import PassContext


def _rng_state(device: torch.device) -> Tensor:
    return torch.get_rng_state() if device.type == "cpu" else torch.get_device_module(device.type).get_rng_state(device)


def _set_rng_state(device: torch.device, state: Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _keep(tensor: Tensor) -> Tensor:
    """Saved-tensor pack hook that keeps the tensor (detached: a saved output that referred to
    its own graph node would be a reference cycle through C++ that no collector frees)."""
    return tensor.detach()


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


class AttentionReplay:
    """The Bayesian attention calls of one checkpointed forward pass, replayed by its recomputations.

    The first run of the checkpointed function records; every later run (a recomputation; there
    may be several, with ``retain_graph``) replays the calls from the first.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[Tensor, Tensor]] = []  # (weights, generator state after the call)
        self.recorded = False
        self.position: Optional[int] = None  # the next call to replay; None while recording
        self._generators: dict[torch.device, Tensor] = {}  # states to restore after a replay

    @contextmanager
    def running(self) -> Iterator[None]:
        """One run of the checkpointed function: records the first time, replays after."""
        replaying = self.recorded
        self.position = 0 if replaying else None
        try:
            with _REGIONS.entered(self):
                yield
        finally:
            for device, state in self._generators.items():
                _set_rng_state(device, state)
            self._generators.clear()
            self.recorded = True

    def attend(self, attention: Callable[[], Tensor], like: Tensor, shape: torch.Size) -> Tensor:
        """The result of one Bayesian attention call (its weights, or on the fused path its output):
        ``attention()`` when recording, the recorded result when replaying. ``like`` (the scores or
        the queries) tells the device and whether the result needs a gradient; ``shape``, the
        result's, checks the replay. On the fused path the forward pass keeps the call's inputs
        (queries, keys, values, not a map) and the backward pass regenerates its noise from the
        seed it recorded, so the replay only hands back the output."""
        if self.position is None:
            with torch.autograd.graph.saved_tensors_hooks(_keep, _unpack):
                weights = attention()
            # the values only: a recomputation only supplies saved values to the forward pass's
            # graph, and a reference to that graph from here would close a cycle through
            # autograd's C++ nodes (graph -> checkpoint -> this record) that no collector frees
            self.calls.append((weights.detach(), _rng_state(like.device)))
            return weights
        if self.position >= len(self.calls):
            raise RuntimeError("the recomputation of a checkpointed layer called Bayesian attention more often than its forward pass")
        weights, state = self.calls[self.position]
        self.position += 1
        if weights.shape != shape:
            raise RuntimeError(
                f"the recomputation of a checkpointed layer called Bayesian attention for a result of shape {tuple(shape)} "
                f"where its forward pass had {tuple(weights.shape)}"
            )
        self._generators.setdefault(like.device, _rng_state(like.device))
        _set_rng_state(like.device, state)
        # as in the forward pass, the ops that follow save what a tensor that needs a gradient needs
        return weights.detach().requires_grad_(like.requires_grad)


#: the checkpointed regions running on this thread
_REGIONS: PassContext[Optional[AttentionReplay]] = PassContext(None)


def active_replay() -> Optional[AttentionReplay]:
    """The innermost checkpointed region running on this thread, or None."""
    return _REGIONS.current()


class BamCheckpoint:
    """A checkpoint function (``checkpoint(function, *args)``, as transformers calls it) that
    records and replays Bayesian attention (see the module doc), wrapping transformers' own.

    transformers' functions are ``functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)``
    (or its offloading variant); their ``use_reentrant`` is overridden with False, with a warning
    if True was asked for. Any other function must already checkpoint without reentrant autograd,
    or the first call fails.
    """

    def __init__(self, checkpoint: Callable[..., Any]) -> None:
        self.checkpoint = checkpoint
        self.overrides: dict[str, Any] = {}
        if isinstance(checkpoint, functools.partial):
            if checkpoint.keywords.get("use_reentrant", False):
                warnings.warn(
                    "gradient checkpointing with use_reentrant=True: layers with Bayesian attention are checkpointed "
                    "with use_reentrant=False instead (reentrant checkpointing runs the forward pass without autograd, "
                    "so the KL of their attention sites would get no gradient)",
                    stacklevel=2,
                )
            self.overrides["use_reentrant"] = False

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        replay = AttentionReplay()
        grad_enabled = torch.is_grad_enabled()

        def run(*inputs: Any) -> Any:
            if grad_enabled and not torch.is_grad_enabled():
                raise RuntimeError(
                    "the checkpoint function ran a layer with Bayesian attention without autograd (reentrant "
                    "checkpointing); use torch.utils.checkpoint.checkpoint with use_reentrant=False"
                )
            with replay.running():
                return function(*inputs)

        return self.checkpoint(run, *args, **{**kwargs, **self.overrides})


def replay_bayesian_checkpoints(layer: nn.Module, args: Any) -> None:
    """Forward pre-hook of a transformers layer with Bayesian attention: whichever checkpoint
    function ``gradient_checkpointing_enable`` gave it, wrap it in :class:`BamCheckpoint`."""
    # private: transformers takes no checkpoint function of one's own, only its keywords (tests/test_private_names.py)
    checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
    if getattr(layer, "gradient_checkpointing", False) and checkpoint is not None and not isinstance(checkpoint, BamCheckpoint):
        layer._gradient_checkpointing_func = BamCheckpoint(checkpoint)
