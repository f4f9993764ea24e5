"""The latent-alignment family of Deng et al. (2018), "Latent Alignment and Variational Attention", in Pyro.

The translation network (bi-LSTM encoder, LSTM decoder fed the *soft* context, MLP attention,
output ``softmax(W tanh(L [h_j; c_j]))``) is shared with soft and Bayesian attention; here the
context is a latent alignment instead:

    p(z_j | x, y_<j) = Categorical(softmax_i(a_ji))          the decoder's attention (padding excluded)
    p(y_j | x, y_<j, z_j = i) = softmax(generate(h_j, x_i))

Input feeding of the soft context makes the decoder states h_j, hence the attention a_j, a
deterministic function of (x, y_<j): the alignments z_j are independent across target positions
given them, and one ``Categorical`` site ``"alignment"`` inside the plates ``sentences`` x
``positions`` carries them all, beside the observed site ``"y"``.

Variants (the paper's Table 1), each a Pyro model + guide + loss (:func:`elbo_for`,
:func:`bam_pyro.alignment.guide_for`):

=============  ===============================================  ==================  ==================
variant        objective per token                              guide               loss
=============  ===============================================  ==================  ==================
``exact``      ``log sum_i p(z=i) p(y | i)`` (marginal)          none                ``TraceEnum_ELBO``
``hard``       ``E_p[log p(y | z)]``, one draw, REINFORCE        q = p (model's)     :class:`AlignmentELBO`
``hard-enum``  ``E_p[log p(y | z)]``, enumerated                 q = p (model's)     :class:`AlignmentELBO`
``va-enum``    ``E_q[log p(y | z)] - KL(q || p)``, enumerated    inference network   ``TraceEnum_ELBO``
``va-sample``  the same, one draw, REINFORCE, KL exact           inference network   :class:`AlignmentELBO`
``va-relaxed`` Dirichlet z, reparameterized draw, KL analytic    q = p, then network ``TraceMeanField_ELBO``
=============  ===============================================  ==================  ==================

The sampled variants use the soft-attention likelihood ``log p(y_j | x, E_p[z_j])`` as baseline
(attached to the observed site ``"y"``). Under the ``mean`` reduction every site carries the
weight 1/(number of target tokens), so the loss is per target token, as for soft and BAM; the KL
(variational variants) is further weighted by ``kl_weight * lambda_t`` (the paper anneals nothing:
leave ``anneal_rate`` unset to follow it).

Memory: enumerating builds logits ``[S, B, T, V]``; :class:`TokensGivenAlignment` scores the
observed token only, at once up to ``max_logit_elements`` logits and beyond that in chunks recomputed
in the backward pass (see :mod:`bam_pyro.alignment.distributions`). Prediction marginalizes the alignment exactly or
over the top-K alignments (the paper's K-max, K=5), again in chunks.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import TraceEnum_ELBO, TraceMeanField_ELBO, config_enumerate, infer_discrete
from torch import Tensor, nn

from ..config import ObjectiveConfig
from ..model import BamModel
from ..validation import whole_number

from .distributions import MaskedDirichlet, TokensGivenAlignment, dirichlet_concentration
from .elbo import AlignmentELBO
from .plates import target_plates

#: name of the latent alignment site (model and guide)
ALIGNMENT = "alignment"
#: name of the observed target-token site
TOKENS = "y"
#: plate dims: sentences (-2) x target positions (-1); enumeration uses dim -3
MAX_PLATE_NESTING = 2


class EncodedSource(Protocol):
    """What the model reads of the encoder's output."""

    @property
    def states(self) -> Tensor: ...  # [B, S, E] encoder states x_i

    @property
    def mask(self) -> Tensor: ...  # [B, S] True at real source tokens


class DecoderSteps(Protocol):
    """What the model reads of the decoder's output, teacher forced ``[B, T, .]`` or one step ``[N, .]``."""

    @property
    def states(self) -> Tensor: ...  # [..., D] decoder states h_j (the attention's queries)

    @property
    def scores(self) -> Tensor: ...  # [..., S] attention scores a_ji before the softmax, padding not masked


class AlignmentNetwork(Protocol):
    """The translation network as the latent-alignment models use it (``models.nmt.Seq2Seq``)."""

    vocab_size: int

    def encode(self, src: Tensor, src_mask: Tensor) -> EncodedSource: ...

    def decoder_states(self, memory: EncodedSource, tgt_in: Tensor) -> DecoderSteps: ...

    def generate(self, states: Tensor, contexts: Tensor) -> Tensor:
        """Logits ``[..., V]``; the leading dims of states ``[..., D]`` and contexts ``[..., E]`` broadcast."""
        ...


@dataclass(frozen=True)
class VariantSpec:
    """How a variant maps onto Pyro (see the module doc's table).

    guide: ``none`` (the alignment is summed out in the model), ``prior`` (q is the model's own
    attention) or ``inference`` (q(z | x, y) from an inference network reading the whole target).
    enumerate: the expectation over the alignment is exact (enumerated) rather than sampled.
    relaxed: Dirichlet alignments (a mixture of source positions) instead of categorical ones.
    """

    guide: str
    enumerate: bool
    relaxed: bool = False

    @property
    def has_kl(self) -> bool:
        """A KL term to weight: only q from an inference network differs from p."""
        return self.guide == "inference"

    @property
    def needs_baseline(self) -> bool:
        return self.guide != "none" and not self.enumerate and not self.relaxed


ALIGNMENT_VARIANTS: dict[str, VariantSpec] = {
    "exact": VariantSpec(guide="none", enumerate=True),
    "hard": VariantSpec(guide="prior", enumerate=False),
    "hard-enum": VariantSpec(guide="prior", enumerate=True),
    "va-enum": VariantSpec(guide="inference", enumerate=True),
    "va-sample": VariantSpec(guide="inference", enumerate=False),
    "va-relaxed": VariantSpec(guide="inference", enumerate=False, relaxed=True),
}


def variant_spec(variant: str) -> VariantSpec:
    """The spec of a variant name, or an error naming the known ones."""
    if variant not in ALIGNMENT_VARIANTS:
        raise ValueError(f"unknown latent-alignment variant {variant!r}; expected one of {sorted(ALIGNMENT_VARIANTS)}")
    return ALIGNMENT_VARIANTS[variant]


@dataclass(frozen=True)
class AlignmentConfig:
    """Settings of a latent-alignment model.

    variant: one of :data:`ALIGNMENT_VARIANTS`.
    top_k: prediction (``log_probs``, ``next_token_log_probs``) over the K most probable alignments,
        renormalized (the paper's K-max, K=5); None: exact enumeration over the source.
    relaxed_samples: prediction of ``va-relaxed``: Monte Carlo draws of the Dirichlet alignment.
    max_logit_elements: most logits (floats) built at once when enumerating alignments. Up to it, a
        batch is scored in one piece; beyond it, in chunks whose output layer runs again in the
        backward pass (a third more work). The default, 2**28 (1 GB of float32), takes most Multi30k
        training batches at the cpu preset in one piece; ``python -m experiments.bench nmt`` measured
        ``exact`` at 7.7 s a step with it, 10.5 s with chunks of 2**24 (the peak memory of a step
        grows about fourfold, to a few GB).
    """

    variant: str = "va-enum"
    top_k: Optional[int] = None
    relaxed_samples: int = 10
    max_logit_elements: int = 2**28

    def __post_init__(self) -> None:
        variant_spec(self.variant)
        for name in ("relaxed_samples", "max_logit_elements"):
            whole_number(name, getattr(self, name))
        whole_number("top_k", self.top_k, optional=True)

    @property
    def spec(self) -> VariantSpec:
        return ALIGNMENT_VARIANTS[self.variant]


def masked_scores(scores: Tensor, source_mask: Tensor) -> Tensor:
    """Attention logits with padded sources at the most negative float: probability exactly 0,
    finite everywhere (an infinite logit would poison the gradients Pyro masks with ``where``)."""
    return scores.masked_fill(~source_mask, torch.finfo(scores.dtype).min)


class LatentAlignmentModel(BamModel):
    """Pyro model of target sentences with a latent alignment per target token (see module doc).

    ``model(src, src_mask, tgt_in, tgt_mask, tgt_out=None, step=None)``, all ``[B, S]`` / ``[B, T]`` with
    True at real tokens in the masks; ``tgt_out`` observed when given; ``step``: the training step
    of the KL annealing (:meth:`~bam_pyro.BamModel.kl_scale`). ``inference``: the network of the
    variational guide (``guides.alignment.InferenceNetwork`` in the translation task), required by the ``va-*`` variants;
    it is registered here so that one optimizer and one checkpoint hold both networks, and the model
    never calls it.
    """

    network: AlignmentNetwork

    def __init__(self, network: nn.Module, objective: ObjectiveConfig, config: AlignmentConfig,
                 inference: Optional[nn.Module] = None) -> None:
        super().__init__(network, objective)
        spec = config.spec
        if spec.guide == "inference" and inference is None:
            raise ValueError(f"variant {config.variant!r} needs an inference network (q reads the whole target)")
        if spec.guide != "inference" and inference is not None:
            raise ValueError(f"variant {config.variant!r} has no inference network; pass inference=None")
        self.config, self.spec, self.inference = config, spec, inference
        self.top_k = config.top_k

    # --- the Pyro model -----------------------------------------------------------------------

    def model(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor,
              tgt_out: Optional[Tensor] = None, step: Optional[int] = None) -> Tensor:
        self.register_parameters()  # Pyro's SVI trains the params a model declares (BamModel.model's rule)
        memory = self.network.encode(src, src_mask)
        steps = self.network.decoder_states(memory, tgt_in)
        alignment_logits = masked_scores(steps.scores, memory.mask.unsqueeze(-2))
        kl_scale = self.kl_scale(step) if self.spec.has_kl else 1.0
        with self.target_plates(tgt_mask):
            if self.spec.relaxed:
                prior = MaskedDirichlet(dirichlet_concentration(steps.scores), memory.mask.unsqueeze(-2))
                with poutine.scale(scale=kl_scale):
                    weights = pyro.sample(ALIGNMENT, prior)
                token_logits = self.network.generate(steps.states, torch.matmul(weights, memory.states))
                return pyro.sample(TOKENS, dist.Categorical(logits=token_logits), obs=tgt_out)
            with poutine.scale(scale=kl_scale):
                alignment = pyro.sample(ALIGNMENT, dist.Categorical(logits=alignment_logits),
                                        infer={"enumerate": "parallel"} if self.spec.enumerate else {})
            tokens = TokensGivenAlignment(self.network.generate, steps.states, memory.states, alignment,
                                          self.network.vocab_size, self.config.max_logit_elements)
            infer: dict = {}
            if self.spec.needs_baseline and tgt_out is not None:
                baseline = self.soft_log_likelihood(steps.states, alignment_logits, memory.states, tgt_out)
                infer["baseline"] = {"baseline_value": baseline}
            return pyro.sample(TOKENS, tokens, obs=tgt_out, infer=infer)

    @torch.no_grad()
    def posterior_alignments(self, draws: int, src: Tensor, src_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor,
                             tgt_out: Tensor) -> Tensor:
        """Alignments ``[draws, B, T]`` from the model's exact posterior given the target,
        ``p(z_j | x, y_<=j)`` proportional to ``p(z_j | x, y_<j) p(y_j | x, y_<j, z_j)``, whatever the
        variant's training estimator: Pyro's ``infer_discrete`` over the alignment enumerated, in one
        pass (the draws a plate left of the model's). Categorical variants only."""
        if self.spec.relaxed:
            raise ValueError("va-relaxed's alignments are Dirichlet weights: there is no categorical posterior to enumerate")

        def in_draws() -> Tensor:
            with pyro.plate("draws", draws, dim=-1 - MAX_PLATE_NESTING):
                return self.model(src, src_mask, tgt_in, tgt_mask, tgt_out)

        sampler = infer_discrete(config_enumerate(in_draws, default="parallel"), first_available_dim=-2 - MAX_PLATE_NESTING)
        return poutine.trace(sampler).get_trace().nodes[ALIGNMENT]["value"]

    def target_plates(self, tgt_mask: Tensor) -> contextlib.AbstractContextManager[None]:
        """The translation task's target plates (:func:`bam_pyro.alignment.target_plates`)."""
        return target_plates(tgt_mask, self.objective.reduction)

    @torch.no_grad()
    def soft_log_likelihood(self, states: Tensor, logits: Tensor, memory: Tensor, tokens: Tensor) -> Tensor:
        """The baseline ``log p(y_j | x, E_p[z_j])``: the observed tokens' log-probabilities with the
        soft context ``sum_i p(z_j = i) x_i``, ``[B, T]``, without gradient."""
        contexts = torch.matmul(logits.softmax(-1), memory)
        return self.network.generate(states, contexts).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    # --- prediction ---------------------------------------------------------------------------

    @property
    def top_k(self) -> Optional[int]:
        """Prediction over the K most probable alignments (None: all of them)."""
        return self._top_k

    @top_k.setter
    def top_k(self, value: Optional[int]) -> None:
        whole_number("top_k", value, optional=True)
        self._top_k = value

    def log_probs(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, tgt_mask: Tensor) -> Tensor:
        """Next-token log-probabilities ``[B, T, V]`` of every target step, teacher forced, the
        alignment marginalized as :meth:`predict` does. ``tgt_mask`` is unused (the interface of soft
        attention's ``Translator.log_probs``)."""
        memory = self.network.encode(src, src_mask)
        return self.predict(memory, self.network.decoder_states(memory, tgt_in))

    def next_token_log_probs(self, memory: EncodedSource, outputs: DecoderSteps) -> Tensor:
        """One decoding step: ``outputs`` of ``N`` hypotheses -> log-probabilities ``[N, V]``."""
        return self.predict(memory, outputs)

    def predict(self, memory: EncodedSource, steps: DecoderSteps) -> Tensor:
        """``log p(y_j | x, y_<j)`` ``[..., V]`` for decoder steps ``[B, T, .]`` or ``[N, .]``: exact
        enumeration over the source, the top-K alignments renormalized, or (``va-relaxed``)
        ``relaxed_samples`` Dirichlet draws from the prior."""
        one_step = steps.states.dim() == 2
        states = steps.states.unsqueeze(1) if one_step else steps.states
        scores = steps.scores.unsqueeze(1) if one_step else steps.scores
        log_weights, contexts_of = self._candidates(scores, memory)
        log_probs = mixture_log_probs(self.network.generate, states, log_weights, contexts_of,
                                      self.network.vocab_size, self.config.max_logit_elements)
        return log_probs.squeeze(1) if one_step else log_probs

    def _candidates(self, scores: Tensor, memory: EncodedSource) -> tuple[Tensor, Callable[[int, int], Tensor]]:
        """The alignments prediction averages over: log-weights ``[B, T, C]`` and, for candidates
        ``a..b-1``, their contexts (broadcastable to ``[B, T, b-a, E]``)."""
        source, mask = memory.states, memory.mask.unsqueeze(-2)
        if self.spec.relaxed:
            draws = MaskedDirichlet(dirichlet_concentration(scores), mask).sample((self.config.relaxed_samples,))
            draws = draws.movedim(0, -2)  # [B, T, M, S]

            def mixed(a: int, b: int) -> Tensor:
                return torch.matmul(draws[..., a:b, :], source.unsqueeze(1))

            return draws.new_full(draws.shape[:-1], -math.log(draws.size(-2))), mixed
        log_prior = masked_scores(scores, mask).log_softmax(-1)
        if self.top_k is None:
            return log_prior, lambda a, b: source[:, None, a:b]
        top, index = log_prior.topk(min(self.top_k, log_prior.size(-1)), dim=-1)
        return top.log_softmax(-1), lambda a, b: aligned_candidates(source, index[..., a:b])


def aligned_candidates(memory: Tensor, index: Tensor) -> Tensor:
    """Encoder states of candidate alignments: ``memory [B, S, E]``, ``index [B, T, C]`` -> ``[B, T, C, E]``."""
    rows = torch.arange(memory.size(0), device=memory.device)[:, None, None]
    return memory[rows, index]


def mixture_log_probs(generate: Callable[[Tensor, Tensor], Tensor], states: Tensor, log_weights: Tensor,
                      contexts_of: Callable[[int, int], Tensor], vocab_size: int, max_elements: int) -> Tensor:
    """``log sum_c w_c softmax(generate(h, context_c))`` ``[B, T, V]`` over candidates c with log-weights
    ``[B, T, C]``; ``contexts_of(a, b)`` gives the contexts of candidates a..b-1, broadcastable to
    ``[B, T, b-a, E]``. Candidates are taken in chunks of at most ``max_elements`` logits."""
    batch, length, count = log_weights.shape
    chunk = max(1, max_elements // (batch * length * vocab_size))
    total: Optional[Tensor] = None
    for start in range(0, count, chunk):
        stop = min(start + chunk, count)
        log_probs = generate(states.unsqueeze(-2), contexts_of(start, stop)).log_softmax(-1)
        part = torch.logsumexp(log_probs + log_weights[..., start:stop, None], dim=-2)
        total = part if total is None else torch.logaddexp(total, part)
    assert total is not None
    return total


@torch.no_grad()
def teacher_forced_perplexity(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]) -> float:
    """``exp(-mean log p(y_j | x, y_<j))`` over the target tokens of ``(src, src_mask, tgt_in, tgt_mask,
    tgt_out)`` batches, with the model's ``log_probs`` (as it predicts), in eval mode."""
    was_training = model.training
    model.eval()
    try:
        total, count = 0.0, 0
        for src, src_mask, tgt_in, tgt_mask, tgt_out in batches:
            log_probs = model.log_probs(src, src_mask, tgt_in, tgt_mask)
            observed = log_probs.gather(-1, tgt_out.unsqueeze(-1)).squeeze(-1)
            total += float(observed[tgt_mask].sum())
            count += int(tgt_mask.sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no target tokens to score")
    return math.exp(-total / count)


class DifferentiableLoss(Protocol):
    """What a trainer needs of a loss (Pyro's ELBOs and :class:`AlignmentELBO`)."""

    def differentiable_loss(self, model: Callable, guide: Callable, *args, **kwargs) -> Tensor: ...


def elbo_for(variant: str) -> DifferentiableLoss:
    """The loss of a variant (see the module doc's table)."""
    spec = variant_spec(variant)
    if spec.relaxed:
        return TraceMeanField_ELBO(max_plate_nesting=MAX_PLATE_NESTING)
    if spec.guide == "prior" or not spec.enumerate:
        return AlignmentELBO(max_plate_nesting=MAX_PLATE_NESTING)
    return TraceEnum_ELBO(max_plate_nesting=MAX_PLATE_NESTING)
