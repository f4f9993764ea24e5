"""The Pyro model of a network with Bayesian attention: attention priors, then the likelihood.

    for each attention call l:  S_l ~ p(S_l | keys_l)            (sites declared by the layers)
    y ~ p(y | x, S)                                               (declared by the task)

A task subclasses :class:`BamModel` and writes :meth:`BamModel.likelihood`; the guide is
:class:`~bam_pyro.guide.AttentionGuide` (``guide = AttentionGuide(bam_model.model)``).

The objective (the paper's eq. 5), and where each factor of it is applied. Training minimizes

    loss = - w_y * log p(y | x, S)  +  kl_weight * lambda_t * sum_l w_l * KL(q(S_l | Phi_l) || p(S_l | keys_l))

with one draw S ~ q per step (the layers above l see the draw of the layers below: the paper's
semi-analytic KL) and

- ``lambda_t = sigmoid(t * rho)``, ``t`` the training step the loop passes as ``model(..., step=t)``
  (``ObjectiveConfig.anneal_rate``), times ``kl_weight`` (the paper's att_kl): :meth:`BamModel.kl_scale`,
  applied to every attention site of model and guide with ``poutine.scale`` (:mod:`bam_pyro.sites`);
- the reduction (``ObjectiveConfig.reduction``): ``sum`` sets ``w_y = w_l = 1``, the plain ELBO;
  ``mean`` (the reference code, which the paper's hyperparameters assume) sets ``w_y = 1 / n``
  (the n observed items; :meth:`BamModel.observe`) and ``w_l = 1 / (L * valid entries of site
  l)`` (L sites per pass; ``AttentionSites.sample`` in :mod:`bam_pyro.sites`), so the KL term is
  the per-entry KL averaged over entries and sites;
- ``KL(q || p)``: each site's analytic KL summed over its valid entries
  (:class:`~bam_pyro.attention_map.AttentionMap`, closed forms in :mod:`bam_pyro.kl`), which
  ``TraceMeanField_ELBO`` reads in place of Monte Carlo; :class:`~bam_pyro.elbo.AttentionMeanFieldELBO`
  is that ELBO without the log-densities of attention sites, which it never reads.

The model registers its parameters with Pyro (as ``pyro.module`` does) on every call, so that
Pyro's own ``SVI`` with a ``pyro.optim`` optimizer trains them; a ``torch.optim`` optimizer on
``bam_model.parameters()`` trains the very same tensors. A subclass that writes its own
``model`` (the latent-alignment models of translation) must call :meth:`BamModel.register_parameters`
in it, or ``SVI`` finds nothing to train.

The step is an argument, as the ``annealing_factor`` of Pyro's ``examples/dmm.py``: the training
loop counts its steps in a Python int (``SVITrainer`` saves it in its checkpoint) and passes
``step=t`` to every call of model and guide (the guide hands its arguments to the model). The
model holds no counter of its own, so a pass reads no tensor on the host for it. Model and guide
read only the schedules of ``t`` (``lambda_t`` here, va-relaxed's Jensen warm start in
:class:`bam_pyro.alignment.JensenWarmStart`). A training pass (train mode, gradients on) of an
annealed model without ``step`` raises; outside training the weight is its limit ``kl_weight``.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.params import param_with_module_name
from torch import Tensor, nn

from .attention import BayesianAttention
from .config import ObjectiveConfig
from .sites import attention_sites

#: key of a site's ``infer`` dict that marks it a target of the model (declared by ``observe``):
#: unobserved, it is predicted from the model, never given a posterior of its own
TARGET = "bam_target"

#: the parameters :meth:`BamModel.register_parameters` put in the param store (modules' own
#: tensors, by id, while they live), told apart from values loaded into the store
_MODULE_PARAMETERS: dict[int, weakref.ref] = {}


def _forget(key: int, _: weakref.ref) -> None:
    _MODULE_PARAMETERS.pop(key, None)


def _is_module_parameter(tensor: Tensor) -> bool:
    known = _MODULE_PARAMETERS.get(id(tensor))
    return known is not None and known() is tensor


def _restore(full_name: str, param: nn.Parameter, stored: Tensor) -> None:
    """Copy a param store value into a module's parameter (``ValueError`` naming both shapes if it
    cannot be this parameter's value)."""
    if stored.shape != param.shape:
        raise ValueError(
            f"the param store's {full_name!r} has shape {tuple(stored.shape)}, the model's parameter "
            f"{tuple(param.shape)}: load a store saved from this model, or call pyro.clear_param_store() first"
        )
    with torch.no_grad():
        param.copy_(stored)


class BamModel(nn.Module):
    """Base class of the Pyro models of every task.

    ``network(*inputs)`` is the task's neural network (its attention layers are
    :class:`BayesianAttention`); ``objective`` fixes the reduction, the KL weight and the
    annealing ``lambda_t = sigmoid(t * rho)``, whose training step t the loop passes to
    :meth:`model` as ``step=t``.

    ``num_sites`` is the number of attention sites per pass, L in the mean reduction; by default
    the number of attention modules with a prior. A model that calls one module several times
    (ALBERT's shared layer) sets it to the number of calls.

    ``pyro_name`` names the model's parameters in Pyro's param store:
    ``"<pyro_name>$$$network.<parameter>"`` (see :meth:`register_parameters`).

    Train in float32 (or bfloat16), not with the parameters in float16: the Bayesian attention
    computes in float32 either way, but a plain optimizer loop (the README's Adam) on float16
    parameters turns them NaN or infinite within a step or two. Adam's ``eps`` (1e-8) is below float16's
    smallest number, as are the squares of small gradients, so its update divides zero by zero
    (a parameter without gradient) or a number by zero. Mixed precision (float32 parameters,
    ``torch.autocast`` and a gradient scaler) is the way to use float16's speed.
    """

    def __init__(self, network: nn.Module, objective: ObjectiveConfig, *, pyro_name: str = "bam") -> None:
        super().__init__()
        self.network = network
        self.pyro_name = pyro_name
        self.objective = objective
        self.record_attention = False
        self.register_load_state_dict_pre_hook(_drop_step_buffer)
        layers = [(n, m) for n, m in network.named_modules() if isinstance(m, BayesianAttention)]
        for name, layer in layers:
            layer.site_name = name
        self.num_sites = sum(layer.config.prior is not None for _, layer in layers)

    def kl_scale(self, step: Optional[int]) -> float:
        """``kl_weight * lambda_t``, the weight of the KL term at training step ``step``.

        ``step=None`` outside training (eval mode or no gradients) is the limit ``kl_weight``, where a
        prediction does not depend on it; in training an annealed objective needs its step."""
        if step is None:
            if self.objective.anneal_rate is not None and self.training and torch.is_grad_enabled():
                raise ValueError(f"{type(self).__name__} anneals its KL weight (anneal_rate="
                                 f"{self.objective.anneal_rate}): pass the training step, model(..., step=t)")
            return self.objective.kl_weight
        return self.objective.kl_weight * self.objective.kl_annealing(step)

    def model(self, *inputs: Any, step: Optional[int] = None, **targets: Any) -> Any:
        """The network's pass on ``inputs`` with its attention sites, then the likelihood of
        ``targets``; ``step``: the training step t of the KL annealing (see :meth:`kl_scale`)."""
        mean_over = self.num_sites if self.objective.reduction == "mean" else None
        with attention_sites(self.kl_scale(step), mean_over, self.record_attention):
            outputs = self.network(*inputs)
        self.register_parameters()  # after the pass, which materializes lazy parameters
        self.likelihood(outputs, **targets)
        return outputs

    @torch.compiler.disable  # eager under torch.compile: see the end of the docstring
    def register_parameters(self) -> None:
        """Declare every trainable parameter a Pyro param, under the name ``pyro.module`` gives it.

        Pyro's ``SVI`` optimizes the params a model declares, so without this ``SVI`` with a
        ``pyro.optim`` optimizer would train nothing. The param store holds the module's own
        tensors: the module stays their owner (``state_dict``, a ``torch.optim`` optimizer on
        :meth:`parameters`). An entry of the same name that came from elsewhere (Pyro's
        ``get_param_store().load``, ``set_state``, or the user's ``pyro.param``) is a value to
        restore: it is copied into the module first, as ``pyro.module(..., update_module_params=True)``
        does, so that a saved param store brings the trained model back. An entry that is another
        model's own tensor (an earlier model of the same ``pyro_name`` in this process) is replaced
        instead; ``pyro.module`` would keep it, and ``SVI`` would then train the earlier model's
        tensors while this one computes with its own.

        Bookkeeping without arithmetic, run eagerly under ``torch.compile``: Dynamo stops inside
        ``pyro.param`` (its message is a ``TypedDict`` with optional keys) and the frame it compiles
        there guards on the parameter's name (``name == 'bam$$$network.conv1.lin.weight'``), one
        recompilation per parameter until the recompile limit (issue 44)."""
        store = pyro.get_param_store()
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            full_name = param_with_module_name(self.pyro_name, name)
            stored = store[full_name] if full_name in store else param
            if stored is not param:
                if not _is_module_parameter(stored):
                    _restore(full_name, param, stored)
                del store[full_name]
            _MODULE_PARAMETERS[id(param)] = weakref.ref(param, functools.partial(_forget, id(param)))
            pyro.param(full_name, param)

    def __getstate__(self) -> dict:
        # the param store tags each parameter it returns with a weak reference (``.unconstrained``),
        # which pickle refuses; it sets it again on the next read (Pyro's PyroModule does the same)
        for param in self.parameters():
            param.__dict__.pop("unconstrained", None)
        return super().__getstate__()

    def likelihood(self, outputs: Any, **targets: Any) -> None:
        """Declare the observed sites given the network's outputs (task-specific)."""
        raise NotImplementedError

    @staticmethod
    def align_to_plate(value: Tensor, ndim: int) -> Tensor:
        """Line up a network output with the data plate under vectorized sampling.

        Attention sites sit outside the data plate (dim -1), so with a vectorized sample dim
        (``Predictive(parallel=True)``, vectorized particles) an output laid out ``[n, *rest]``
        (``ndim = 1 + len(rest)``) arrives as ``[*samples, 1, n, *rest]``: the 1 is the plate's slot
        in the attention samples' batch shape. Dropping it gives ``[*samples, n, *rest]``.
        """
        if value.dim() > ndim:
            if value.size(-ndim - 1) != 1:
                raise ValueError(
                    f"expected a singleton data-plate slot at dim {-ndim - 1} of an output of shape "
                    f"{tuple(value.shape)}; is the output laid out [n, ...] with {ndim} dims?"
                )
            value = value.squeeze(-ndim - 1)
        return value

    def observe(self, name: str, fn: dist.TorchDistribution, obs: Optional[Tensor]) -> Tensor:
        """An observed site over a plate of data points (the last batch dim of ``fn``), scaled by
        1/n under the ``mean`` reduction. With ``obs=None`` it is the prediction of the targets."""
        n = fn.batch_shape[-1]
        scale = 1.0 / n if self.objective.reduction == "mean" else 1.0
        with pyro.plate(f"{name}_data", n, dim=-1), poutine.scale(scale=scale):
            return pyro.sample(name, fn, obs=obs, infer={TARGET: True})


def _drop_step_buffer(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Read a state dict saved while the model kept its annealing step as a buffer: the step is the
    training loop's now (``SVITrainer.load`` reads it from such a checkpoint), so it is dropped here."""
    state_dict.pop(prefix + "step", None)
