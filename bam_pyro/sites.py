"""Pyro plumbing: how an attention layer becomes a ``pyro.sample`` site.

Inside :func:`attention_sites` (entered by a Pyro model around its network), every stochastic
attention layer with a prior declares one sample site per call,

    S_l ~ p(S_l | keys_l)          (the prior, in the model)

and attaches its scores Phi_l to the site, from which the amortized guide
(:class:`~bam_pyro.guide.AttentionGuide`, a ``GuideMessenger``) builds q(S_l | Phi_l). Model and guide
therefore share one forward pass of the network; without a guide the site samples the prior.

The site's KL weight (annealing times reduction) is applied with ``poutine.scale``, and
``TraceMeanField_ELBO`` scales the analytic KL by it (a 0-dim tensor where a mask counts the valid
entries: :func:`mean_scale`). Both prior and q are wrapped in
an :class:`~bam_pyro.attention_map.AttentionMap`: one event per attention call, padding masked
out (the KL of padded entries is exactly zero), the KL summed over the valid entries directly.

The active contexts are per-pass state (:class:`~bam_pyro.pass_context.PassContext`, per thread): a
network evaluated in one thread does not join a Pyro model running in another.
``nn.DataParallel``'s replicas, which run in threads, are refused by name
(:func:`refuse_data_parallel_replica`).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from torch import Tensor, nn

from .attention_map import AttentionMap
from .axes import AttentionAxis
from .config import BamConfig
from .distributions import variational_distribution
from .pass_context import PassContext
from .tensor_memo import LastTensorsMemo

#: key of the site's ``infer`` dict that carries what the guide needs
SITE_INFO = "bam_attention"


@dataclass(frozen=True)
class AttentionSiteInfo:
    """What an attention site hands to the guide: the scores Phi and how to read them."""

    phi: Tensor
    config: BamConfig
    mask: Optional[Tensor]
    event_dim: int

    def as_site_distribution(self, fn: dist.TorchDistribution) -> AttentionMap:
        """The site's distribution from an element-wise one: one event, invalid entries masked."""
        return AttentionMap(fn, self.mask, self.event_dim)

    def posterior(self) -> AttentionMap:
        """q(S | Phi), the guide's distribution at the site."""
        return self.as_site_distribution(variational_distribution(self.phi, self.config))

    def num_valid(self, axis: AttentionAxis) -> Union[int, Tensor]:
        """Valid entries of one map (the KL's count under the ``mean`` reduction)."""
        return axis.num_valid(self.phi)

    @property
    def kl_dtype(self) -> torch.dtype:
        """The dtype the site's KL comes in (that of Phi)."""
        return self.phi.dtype


@dataclass
class AttentionSites:
    """State of one model execution: KL weights and the names handed out so far.

    kl_scale: weight of every site's KL (annealing times ``kl_weight``).
    mean_over_sites: for the ``mean`` reduction, the number of attention sites per pass L; each
        site's KL is then divided by its number of valid entries and by L. None: plain sum.
    record_weights: also record each layer's normalized weights W as ``pyro.deterministic``
        sites ``"<site>.weights"``, for ``Predictive``.
    """

    kl_scale: float = 1.0
    mean_over_sites: Optional[int] = None
    record_weights: bool = False
    calls: Counter = field(default_factory=Counter)
    keyed: dict[tuple, LastTensorsMemo] = field(default_factory=dict, repr=False)
    latest: Optional[str] = None  # the name of the latest site declared (:meth:`declare`)

    def once_per_keys(self, owner: nn.Module, keys: Tensor, make: Callable[[], Tensor]) -> Tensor:
        """``make()``, computed once per pass for each ``owner`` and keys: a decoder that attends to
        the same keys at every step (a caption's image grid, a translation's source) computes their
        contextual prior once instead of once per step. Keys are the same when they are the same
        view (shape, strides, offset) of the same tensor, unwritten in between
        (:class:`~bam_pyro.tensor_memo.LastTensorsMemo`; keys made under ``torch.inference_mode``
        count no writes, and get ``make()`` every call). Under ``torch.compile`` it is
        ``make()`` every call: a guard on the tensors' identities recompiled every layer until
        Dynamo's recompilation limit (measured on MiniLM). Encoders lose nothing by it; a compiled
        decoder computes its prior at every step."""
        if torch.compiler.is_compiling():
            return make()
        # private: the tensor a view was made of, which torch exposes under no public name
        # (tests/test_private_names.py); a view's identity is its base with its shape, strides and offset
        root = keys if keys._base is None else keys._base
        tag = (id(owner), id(root), keys.shape, keys.stride(), keys.storage_offset(), keys.dtype)
        memo = self.keyed.get(tag)
        if memo is None:
            memo = self.keyed[tag] = LastTensorsMemo()
        return memo.get(make, root)

    @torch.compiler.disable  # eager under torch.compile: see below
    def declare(self, layer: nn.Module, prior: dist.TorchDistribution, info: "AttentionSiteInfo",
                axis: Optional[AttentionAxis]) -> Tensor:
        """The sample site of one call of ``layer`` (named by :meth:`site_name` from its
        ``site_name``): the drawn S.

        Runs eagerly under ``torch.compile``, and the site's name never enters compiled code. Pyro's
        bookkeeping is specialized on names: Dynamo stops inside ``pyro.sample`` (its message is a
        ``TypedDict`` with optional keys), and every frame it then compiles in between guards on
        the name string it holds, recompiling once per site until the recompile limit. Here the
        compiled network hands the prior and Phi over and gets S back; the attention math before
        and after is one compiled code for all layers of the same shapes (``tests/test_compile.py``)."""
        self.latest = self.site_name(layer.site_name)
        return self.sample(self.latest, prior, info, axis)

    def site_name(self, base: str) -> str:
        """``base`` on the first call of a module, ``base#2``, ``base#3`` ... on repeated calls
        (e.g. ALBERT's shared layer): every call is its own latent variable with its own KL."""
        self.calls[base] += 1
        count = self.calls[base]
        return base if count == 1 else f"{base}#{count}"

    def sample(self, name: str, prior: dist.TorchDistribution, info: AttentionSiteInfo, axis: AttentionAxis) -> Tensor:
        scale = self.kl_scale
        if self.mean_over_sites is not None:
            scale = mean_scale(scale, self.mean_over_sites, info.num_valid(axis), info.kl_dtype)
        with poutine.scale(scale=scale):
            return pyro.sample(name, info.as_site_distribution(prior), infer={SITE_INFO: info})

    @torch.compiler.disable  # eager, as :meth:`declare`
    def record(self, weights: Tensor, event_dim: int) -> None:
        """The weights of the latest site declared, a deterministic site. Callers check
        ``record_weights`` first, so that compiled code does not break its graph here on every call."""
        pyro.deterministic(f"{self.latest}.weights", weights, event_dim=event_dim)


def mean_scale(kl_scale: float, num_sites: int, num_valid: Union[int, Tensor], dtype: torch.dtype) -> Union[float, Tensor]:
    """``kl_scale / (num_sites * max(num_valid, 1))``, the weight of one site's summed KL under the
    ``mean`` reduction. A count the mask gives (a 0-dim tensor) is never read on the host, which
    would be a synchronization per attention call on an accelerator: the weight is a 0-dim tensor
    on its device, computed in float64 (float32 on MPS, which has no float64) and rounded to the
    KL's dtype (at least float32), so it multiplies the KL as the host's float would."""
    if isinstance(num_valid, int):
        return kl_scale / (num_sites * max(num_valid, 1))
    if num_valid.device.type == "mps":
        return kl_scale / (num_sites * num_valid.clamp_min(1).float())
    weight = kl_scale / (num_sites * num_valid.clamp_min(1).double())
    return weight.to(torch.promote_types(dtype, torch.float32))


#: the sites of the Pyro model around the pass, and a request to sample outside one
_SITES: PassContext[Optional[AttentionSites]] = PassContext(None)
_SAMPLING: PassContext[Optional[bool]] = PassContext(None)


@contextmanager
def attention_sites(
    kl_scale: float = 1.0, mean_over_sites: Optional[int] = None, record_weights: bool = False
) -> Iterator[AttentionSites]:
    """Within this context, Bayesian attention layers are Pyro sample sites (see module doc).
    The context is this thread's: layers called in other threads do not see it."""
    with _SITES.entered(AttentionSites(kl_scale, mean_over_sites, record_weights)) as sites:
        yield sites


def active_sites() -> Optional[AttentionSites]:
    return _SITES.current()


@contextmanager
def attention_sampling(enabled: bool = True) -> Iterator[None]:
    """Outside a Pyro model: draw attention from q even in eval mode (default there: the mean).
    The request is this thread's."""
    with _SAMPLING.entered(enabled):
        yield


def sampling_requested() -> Optional[bool]:
    return _SAMPLING.current()


def refuse_data_parallel_replica(module: nn.Module) -> None:
    """Raise if ``module`` is a replica made by ``nn.DataParallel``, which runs its replicas in
    threads of their own: Pyro's effect handlers (the trace the ELBO reads) are process-wide, so
    the replicas' sites would land in one trace under clashing names, and this thread's context
    does not reach them. ``torch.nn.parallel.replicate`` marks each replica ``_is_replica``."""
    if getattr(module, "_is_replica", False):
        raise RuntimeError(
            "Bayesian attention does not run under nn.DataParallel (replicas in threads share Pyro's "
            "process-wide trace): train with one process per device instead (torchrun, Lightning Fabric "
            "--strategy ddp, or the HF Trainer launched with torchrun)")
