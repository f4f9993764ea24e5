"""The private names of Pyro, torch and transformers that bam_pyro still uses, each where no public
route exists: every test asserts the name is there and behaves as the library relies on, so that an
upgrade that changes one fails here, by name, rather than somewhere downstream."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive, TraceMeanField_ELBO
from pyro.poutine.enum_messenger import EnumMessenger
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import get_plates


def model():
    with pyro.plate("data", 3):
        return pyro.sample("z", dist.Normal(0.0, 1.0))


def guide():
    with pyro.plate("data", 3):
        pyro.sample("z", dist.Normal(0.5, 1.0))


def test_pyro_stack_holds_the_active_enum_messenger():
    """bam_pyro.alignment.guides.no_guide: whether enumeration is on."""
    from pyro.poutine.runtime import _PYRO_STACK

    assert not any(isinstance(handler, EnumMessenger) for handler in _PYRO_STACK)
    with poutine.enum(first_available_dim=-2):
        assert any(isinstance(handler, EnumMessenger) for handler in _PYRO_STACK)


def test_get_importance_trace_gives_both_traces_with_log_densities():
    """bam_pyro.alignment.elbo.AlignmentELBO._get_trace."""
    from pyro.infer.enum import get_importance_trace

    model_trace, guide_trace = get_importance_trace("flat", 1, model, guide, (), {})
    assert "log_prob_sum" in model_trace.nodes["z"] and "score_parts" in guide_trace.nodes["z"]


def test_elbo_losses_go_through_the_get_trace_hook_and_the_mean_field_check_takes_two_traces():
    """bam_pyro.elbo.AttentionMeanFieldELBO overrides ``_get_trace`` and calls
    ``_check_mean_field_requirement`` as its parent does."""
    from pyro.infer.trace_mean_field_elbo import _check_mean_field_requirement

    calls = []

    class Counting(TraceMeanField_ELBO):
        def _get_trace(self, *args):
            calls.append(args)
            return super()._get_trace(*args)

    Counting().differentiable_loss(model, guide)
    assert len(calls) == 1
    model_trace = poutine.trace(poutine.replay(model, trace=poutine.trace(guide).get_trace())).get_trace()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same sites in the same order: no warning
        _check_mean_field_requirement(model_trace, poutine.trace(guide).get_trace())


def test_mean_field_elbo_sums_each_particle_in_its_differentiable_loss_particle_hook():
    """bam_pyro.elbo.AttentionMeanFieldELBO wraps ``_differentiable_loss_particle`` (run eagerly under
    torch.compile): the parent calls it once per particle with both traces and returns its loss."""
    calls = []

    class Counting(TraceMeanField_ELBO):
        def _differentiable_loss_particle(self, model_trace, guide_trace):
            calls.append((model_trace, guide_trace))
            return super()._differentiable_loss_particle(model_trace, guide_trace)

    loss = Counting(num_particles=2).differentiable_loss(model, guide)
    assert len(calls) == 2 and all("z" in m.nodes and "z" in g.nodes for m, g in calls)
    assert torch.is_tensor(loss)


def test_messengers_handle_sample_sites_in_pyro_sample():
    """bam_pyro.guide.AttentionGuide._pyro_sample reads each site's ``infer`` before the guide draws."""
    seen = []

    class Seeing(Messenger):
        def _pyro_sample(self, msg):
            seen.append(msg["name"])

    with Seeing():
        model()
    assert "z" in seen


def test_predictive_vectorizes_draws_in_a_plate_of_that_name():
    """bam_pyro.predictive: inputs get the draws' dimension of that plate."""
    from pyro.infer.predictive import _predictive_vectorize_plate_name

    frames = []

    def program():
        frames.extend(f for f in get_plates() if f.name == _predictive_vectorize_plate_name)
        return model()

    Predictive(program, num_samples=5, parallel=True).get_vectorized_trace()
    assert [f.size for f in frames] == [5]


def test_a_tensors_version_counts_in_place_writes_only():
    """bam_pyro.tensor_memo.write_count: what the graph check, a layer's nonzeros, a mask's layout
    and the contextual prior derive from tensors is reused until the count moves."""
    x = torch.zeros(3)
    before = x._version
    x + 1
    assert x._version == before
    x.add_(1)
    assert x._version > before


def test_a_views_base_is_the_tensor_it_was_made_of():
    """bam_pyro.sites.AttentionSites.once_per_keys: keys are the same when they are the same view
    (base, shape, strides, offset) of the same tensor; a view of a view has the first tensor as base."""
    x = torch.randn(4, 6)
    view = x[:, 2:].transpose(0, 1)
    assert x._base is None and view._base is x and view[1:]._base is x
    assert x.clone()._base is None and x.reshape(6, 4)._base is x


def test_auto_classes_map_a_config_to_their_model_class():
    """bam_pyro.transformers.from_pretrained with an auto class."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig()
    assert transformers.AutoModelForSequenceClassification._model_mapping[type(config)] is transformers.BertForSequenceClassification


def test_checkpointed_layers_run_their_gradient_checkpointing_func():
    """bam_pyro.transformers.checkpointing wraps it, so that recomputation replays the attention draws."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import GradientCheckpointingLayer

    config = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=8)
    network = transformers.BertModel(config)
    # gradient_checkpointing_enable is its deprecated alias in newer transformers
    getattr(network, "activation_checkpointing_enable", network.gradient_checkpointing_enable)()
    layers = [m for m in network.modules() if isinstance(m, GradientCheckpointingLayer)]
    calls = []
    for layer in layers:
        checkpoint = layer._gradient_checkpointing_func

        def spy(function, *args, checkpoint=checkpoint, **kwargs):
            calls.append(function)
            return checkpoint(function, *args, **kwargs)

        layer._gradient_checkpointing_func = spy
    network.train()
    network(torch.tensor([[1, 2, 3]])).last_hidden_state.sum().backward()
    assert len(layers) == 2 and len(calls) == 2


def test_output_capturing_collects_the_attention_maps_it_is_asked_for():
    """bam_pyro.transformers.attention.maps_requested: GPT-2 takes ``output_attentions`` off before
    its attention modules run; the collector says the maps are wanted."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils.output_capturing import _active_collector

    seen = []
    config = transformers.GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2)
    network = transformers.GPT2Model(config).eval()
    network.h[0].attn.register_forward_pre_hook(lambda *_: seen.append(_active_collector.get()))
    network(torch.tensor([[1, 2, 3]]), output_attentions=True)
    network(torch.tensor([[1, 2, 3]]))
    assert "attentions" in seen[0] and "attentions" not in (seen[1] or {})
