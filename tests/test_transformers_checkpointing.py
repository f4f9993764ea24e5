"""Gradient checkpointing (transformers' ``gradient_checkpointing_enable``) of a BAM-converted BERT:
the same loss, sites and gradients as without it, in both checkpointing modes, and nothing kept
after the step."""

import copy
import gc
import warnings
import weakref

import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO

import bam_pyro.transformers.checkpointing as checkpointing
from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.sites import SITE_INFO
from bam_pyro.transformers import build_sequence_model

WC = BamConfig("wc", k=10.0, beta=1e-2, d_mid=5)


def batch():
    ids = torch.randint(1000, 2000, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask, torch.tensor([0, 1, 1])


def elbo_step(bam_model, ids, mask, labels):
    """Loss, attention site names and every parameter's gradient of one ELBO step (seeded)."""
    bam_model.train()
    pyro.set_rng_seed(1)
    guide = AttentionGuide(bam_model.model)
    loss = TraceMeanField_ELBO().differentiable_loss(bam_model.model, guide, ids, mask, labels=labels)
    loss.backward()
    model_trace, _ = guide.get_traces()
    sites = [name for name, site in model_trace.nodes.items() if SITE_INFO in (site.get("infer") or {})]
    return loss.detach(), sites, {name: p.grad for name, p in bam_model.named_parameters()}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_gives_the_gradients_of_the_plain_model(tiny_bert_folder, use_reentrant):
    """BERT's dropout (0.1) draws masks after each attention sample: the recomputation must both
    reuse the sample and leave the generator where the forward pass did."""
    reference = build_sequence_model(str(tiny_bert_folder), 2, WC, ObjectiveConfig())
    checkpointed = copy.deepcopy(reference)
    checkpointed.network.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ids, mask, labels = batch()

    loss, sites, grads = elbo_step(reference, ids, mask, labels)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_ckpt, sites_ckpt, grads_ckpt = elbo_step(checkpointed, ids, mask, labels)
    assert any("use_reentrant=False instead" in str(w.message) for w in caught) == use_reentrant

    assert len(sites) == 2 and sites_ckpt == sites  # one site per layer, declared once
    torch.testing.assert_close(loss_ckpt, loss)
    assert sum(".prior_net." in name for name in grads) == 6 and all(g is not None for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, msg=lambda m: f"{name}: {m}")


def test_a_checkpointed_forward_pass_keeps_nothing_once_dropped(tiny_bert_folder, monkeypatch):
    """What a checkpointed layer keeps for its recomputation lives as long as the graph, also
    when no backward pass comes (a reference cycle through autograd's nodes would keep it)."""
    records = []

    class TrackedReplay(checkpointing.AttentionReplay):
        def __init__(self):
            super().__init__()
            records.append(weakref.ref(self))

    monkeypatch.setattr(checkpointing, "AttentionReplay", TrackedReplay)
    bam_model = build_sequence_model(str(tiny_bert_folder), 2, WC, ObjectiveConfig())
    bam_model.network.model.activation_checkpointing_enable()
    bam_model.train()
    ids, mask, _ = batch()
    logits = bam_model.network(ids, mask)
    assert len(records) == 2 and all(r() is not None for r in records)  # alive with the graph
    del logits
    gc.collect()
    assert all(r() is None for r in records)
