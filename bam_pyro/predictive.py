"""Posterior (and prior) predictive samples with ``pyro.infer.Predictive``, in bounded chunks.

For a :class:`~bam_pyro.model.BamModel`, one draw m gives

    S^m ~ q(S | Phi)  at every attention site      (the amortized guide)
    p^m = probs(network(x; S^m))                    class probabilities of every item
    W_l^m                                           attention weights of the chosen layers

``Predictive`` runs the model under :class:`~bam_pyro.guide.AttentionGuide` (one network pass serves
model and guide) inside its vectorizing plate, so a chunk of draws is one batched pass; chunks
keep memory bounded for any number of draws. The class probabilities are recorded as the
deterministic site :data:`PROBS_SITE`, the weights as ``"<site>.weights"``
(``BamModel.record_attention``); both are read from the vectorized trace.

Randomness that is not a Pyro site (dropout in MC-dropout mode, the ``nokl`` variant's attention
noise) would be drawn once per chunk and shared by its draws. In that case the floating-point
inputs get the sample dimensions (``[draws, 1.., *shape]``, aligned with the vectorizing plate),
so that every draw has its own noise; integer inputs (indices, edges) stay as they are. A model
whose inputs are all integers (token ids and masks) has nothing to carry the draws' dimension, so
there each draw is a pass of its own (a chunk of one).

In the vectorized pass the model's targets (the sites ``BamModel.observe`` declares) are not
sampled: the draws are of class probabilities, and a label drawn for every item in every draw
would be thrown away (on Cora, the categorical sampling was an eighth of a draw's time). They hold
a placeholder of their shape instead (``_UnsampledTargets``). The targets come last in a
pass, so a chunk's draws from a given random state are those it gave when the labels were drawn;
``Predictive``'s plate-less probe passes still draw theirs. A later chunk of the same call starts
where the skipped labels leave the random stream, so its draws differ from those it gave before.

Point predictions are not made here: they keep the posterior-mean rule (eval mode, S replaced
by its mean, i.e. softmax attention). These draws are for uncertainty.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive
from pyro.infer.predictive import _predictive_vectorize_plate_name  # private: how to find Predictive's plate (tests/test_private_names.py)
from pyro.poutine.indep_messenger import CondIndepStackFrame
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import get_plates
from torch import Tensor

from .attention import BayesianAttention
from .attention_map import AttentionMap
from .guide import AttentionGuide
from .model import TARGET, BamModel
from .validation import whole_number

#: deterministic site holding the class probabilities ``[..., items, classes]`` of one draw
PROBS_SITE = "predictive.probs"


@dataclass
class PredictiveDraws:
    """``probs``: ``[draws, items, classes]``; ``attention``: site -> weights ``[draws, *entries]``
    (after ``select_attention``); ``prior_location``: site -> the prior's location per entry,
    same layout (see :func:`prior_location`), when requested."""

    probs: Tensor
    attention: dict[str, Tensor]
    prior_location: dict[str, Tensor]


def softmax_probs(logits: Tensor) -> Tensor:
    """Default ``probs_fn``: class probabilities from logits over the last dimension."""
    return logits.softmax(-1)


def attention_site_names(bam_model: BamModel) -> list[str]:
    """Names of the model's attention sites (layers with a prior), in network order."""
    return [
        m.site_name for m in bam_model.network.modules()
        if isinstance(m, BayesianAttention) and m.config.prior is not None
    ]


def has_stochastic_attention(bam_model: BamModel) -> bool:
    """True when some attention layer draws its weights (BAM); False for soft attention only."""
    return any(isinstance(m, BayesianAttention) and m.config.stochastic for m in bam_model.network.modules())


def has_unsited_noise(bam_model: BamModel, dropout: bool) -> bool:
    """True when a draw has randomness that is not a Pyro sample site (dropout, ``nokl``)."""
    return dropout or any(
        isinstance(m, BayesianAttention) and m.config.stochastic and m.config.prior is None
        for m in bam_model.network.modules()
    )


def predictive_draws(
    bam_model: BamModel,
    inputs: Sequence,
    num_samples: int,
    *,
    layers: Optional[Sequence[str]] = None,
    select_attention: Optional[Callable[[Tensor], Tensor]] = None,
    probs_fn: Callable[[object], Tensor] = softmax_probs,
    dropout: bool = False,
    with_prior: bool = False,
    chunk_size: int = 100,
) -> PredictiveDraws:
    """Draw ``num_samples`` predictive class probabilities and attention weights.

    layers: attention sites to keep (default: none; see :func:`attention_site_names`).
    select_attention: applied to each chunk of weights ``[chunk, *entries]`` to keep only the
        entries of interest (e.g. the edges into a few nodes), so memory stays small.
    probs_fn: network outputs -> class probabilities ``[..., items, classes]``.
    dropout: MC dropout, the network in training mode (the soft variant's only uncertainty).
    with_prior: also return each layer's prior location given the draw (the prior of a layer
        depends on the attention samples of the layers below it).
    """
    whole_number("num_samples", num_samples)
    whole_number("chunk_size", chunk_size)
    layers = list(layers or [])
    unknown = set(layers) - set(attention_site_names(bam_model))
    if unknown:
        raise ValueError(f"unknown attention sites {sorted(unknown)}; the model has {attention_site_names(bam_model)}")
    expand = has_unsited_noise(bam_model, dropout)
    if expand and not any(torch.is_tensor(a) and a.is_floating_point() for a in inputs):
        chunk_size = 1  # see module doc: draws of one pass would share their noise

    def program(*args):
        if expand:
            args = _expand_in_sample_plate(args)
        with _UnsampledTargets():
            outputs = bam_model.model(*args)
        probs = probs_fn(outputs)
        pyro.deterministic(PROBS_SITE, probs, event_dim=2)
        return outputs

    guide = AttentionGuide(program)
    probs, attention, prior = [], {name: [] for name in layers}, {name: [] for name in layers}
    keep = select_attention or (lambda w: w)
    with _sampling_state(bam_model, dropout, record=bool(layers)), torch.no_grad():  # draws, not training
        for start in range(0, num_samples, chunk_size):
            size = min(chunk_size, num_samples - start)
            trace = Predictive(guide, num_samples=size, parallel=True).get_vectorized_trace(*inputs)
            probs.append(_per_draw(trace.nodes[PROBS_SITE], size))
            for name in layers:
                attention[name].append(keep(_per_draw(trace.nodes[f"{name}.weights"], size)))
                if with_prior:
                    site = trace.nodes[name]
                    location = prior_location(site["infer"]["prior"]).reshape(-1, *site["fn"].event_shape)
                    prior[name].append(keep(location.expand(size, *location.shape[1:])))
            del trace
    draws = PredictiveDraws(_concat({PROBS_SITE: probs})[PROBS_SITE], _concat(attention), _concat(prior))
    _check_probs(draws.probs)
    return draws


class _UnsampledTargets(Messenger):
    """Leaves a model's unobserved targets undrawn in ``Predictive``'s vectorized pass: their value
    is a zero placeholder of the site's shape (a broadcast view on the CPU, no memory), since the
    draws keep class probabilities, not labels. ``BamModel.model`` discards what its likelihood
    returns, so nothing reads it."""

    def _pyro_sample(self, msg: dict) -> None:  # the handler Pyro's Messenger subclasses override (tests/test_private_names.py)
        if msg["value"] is None and msg["infer"].get(TARGET) and _vectorizing_frame() is not None:
            fn = msg["fn"]
            dtype = torch.long if fn.support.is_discrete else torch.get_default_dtype()
            msg["value"] = torch.zeros((), dtype=dtype).expand(fn.batch_shape + fn.event_shape)


def prior_location(prior: dist.TorchDistribution) -> Tensor:
    """Where an attention prior p(S) is centred, per entry: the Gamma mean ``alpha / beta`` or the
    LogNormal median ``exp(mu)``: proportional to the contextual prior's Psi (``Psi / beta`` when
    ``gamma_shape="psi"``, so normalize over each query's keys to get the prior's attention) or,
    for a fixed prior, a constant (normalized over the keys: uniform weights)."""
    base = prior
    while isinstance(base, (AttentionMap, dist.Independent, dist.MaskedDistribution)):
        base = base.base_dist
    if isinstance(base, dist.Gamma):
        return base.concentration / base.rate
    if isinstance(base, dist.LogNormal):
        return base.loc.exp()
    raise TypeError(f"no attention prior location for {type(base).__name__}")


def _expand_in_sample_plate(args: tuple) -> tuple:
    """Give floating-point inputs the dims of Predictive's vectorizing plate (if it is active)."""
    frame = _vectorizing_frame()
    if frame is None:  # Predictive's unvectorized probe runs: one draw is enough
        return args
    lead = (frame.size,) + (1,) * (-frame.dim - 1)
    return tuple(
        a.expand(*lead, *a.shape) if torch.is_tensor(a) and a.is_floating_point() else a for a in args
    )


def _vectorizing_frame() -> Optional[CondIndepStackFrame]:
    """The frame of ``Predictive``'s vectorizing plate while it is active, else None."""
    return next((f for f in get_plates() if f.name == _predictive_vectorize_plate_name), None)


def _concat(chunks: dict[str, list[Tensor]]) -> dict[str, Tensor]:
    """The chunks of each site joined; a single chunk is not copied unless it is a broadcast view
    (a value that did not vary over the draws), which would share its memory between draws."""
    return {name: parts[0].contiguous() if len(parts) == 1 else torch.cat(parts) for name, parts in chunks.items() if parts}


def _per_draw(site: dict, size: int) -> Tensor:
    """A recorded site's value as ``[size, *event]``: drop the plate slots, broadcast a value
    that did not vary over the draws."""
    event_shape = site["fn"].event_shape
    value = site["value"].reshape(-1, *event_shape)
    if value.shape[0] not in (1, size):
        raise RuntimeError(
            f"site {site['name']!r} has {value.shape[0]} draws, expected {size}: "
            "record it with the event_dim of one draw"
        )
    return value.expand(size, *event_shape)


@contextmanager
def _sampling_state(bam_model: BamModel, dropout: bool, record: bool) -> Iterator[None]:
    """Train mode for MC dropout (eval otherwise) and attention recording, restored afterwards."""
    was_training, was_recording = bam_model.training, bam_model.record_attention
    bam_model.train(dropout)
    bam_model.record_attention = record
    try:
        yield
    finally:
        bam_model.train(was_training)
        bam_model.record_attention = was_recording


def _check_probs(probs: Tensor) -> None:
    if probs.dim() != 3:
        raise ValueError(f"probs_fn must give [items, classes] per draw; got draws of shape {tuple(probs.shape)}")
    total = probs.sum(-1)
    if not torch.isfinite(probs).all() or (total - 1).abs().max() > 1e-4:
        raise ValueError("probs_fn must return probabilities that sum to one over the last dimension")
