"""bam_pyro.tensor_memo: what is derived from tensors is reused only while the very same tensors
come back unwritten, never for inference tensors, and never keeps a tensor alive; and the library's
users of it (graph checks, nonzeros, mask layouts, contextual priors) run under
``torch.inference_mode`` as they do under ``torch.no_grad``."""

import copy
import gc
import pickle
import weakref

import pyro
import pytest
import torch
from torch import nn

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.sites import AttentionSites
from bam_pyro.tensor_memo import LastTensorsMemo, write_count
from models.gat import build_node_classifier

from .conftest import random_graph


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.calls


def test_a_value_is_reused_only_for_the_same_tensors_unwritten_and_the_same_key():
    x, y = torch.zeros(3), torch.ones(2)
    memo, derive = LastTensorsMemo(), Counting()
    assert memo.get(derive, x, y) == 1
    assert memo.get(derive, x, y) == 1
    assert memo.get(derive, x.clone(), y) == 2  # equal values, another tensor
    assert memo.get(derive, x, y) == 3  # the memo holds the last call only
    assert memo.get(derive, x, y, key="other sizes") == 4
    assert memo.get(derive, x, y, key="other sizes") == 4
    x.add_(0.0)  # an in-place write, even of nothing, counts
    assert memo.get(derive, x, y, key="other sizes") == 5
    assert memo.get(derive, y, x, key="other sizes") == 6  # order matters
    assert memo.get(derive, x, key="other sizes") == 7  # so does the number of tensors


def test_inference_tensors_are_derived_every_call_and_the_other_tensors_still_reuse():
    memo, derive = LastTensorsMemo(), Counting()
    x = torch.zeros(3)
    assert memo.get(derive, x) == 1
    with torch.inference_mode():
        frozen = torch.zeros(3)
        assert write_count(frozen) is None and write_count(x) == x._version
        assert memo.get(derive, frozen) == 2
        assert memo.get(derive, frozen) == 3
        assert memo.get(derive, x, frozen) == 4
    assert memo.get(derive, x) == 1  # calls with inference tensors do not displace the entry


def test_a_failing_derivation_leaves_the_memo_as_it_was():
    memo, x = LastTensorsMemo(), torch.zeros(3)
    memo.get(lambda: "checked", x)

    def fails():
        raise ValueError("NaN in x")

    with pytest.raises(ValueError, match="NaN"):
        memo.get(fails, x.clone())
    assert memo.get(fails, x) == "checked"


def test_the_memo_keeps_no_tensor_alive_and_copies_start_empty():
    memo, derive = LastTensorsMemo(), Counting()
    x = torch.zeros(3)
    memo.get(derive, x)
    assert pickle.loads(pickle.dumps(memo)).get(derive, x) == 2
    assert copy.deepcopy(memo).get(derive, x) == 3
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None
    assert memo.get(derive, torch.zeros(3)) == 4  # a new tensor, wherever it lives


def test_a_pass_derives_the_prior_of_the_same_keys_once_per_owner_and_view():
    sites, owner, other_owner = AttentionSites(), nn.Linear(1, 1), nn.Linear(1, 1)
    keys, derive = torch.randn(2, 5, 4), Counting()
    assert sites.once_per_keys(owner, keys, derive) == 1
    assert sites.once_per_keys(owner, keys[:], derive) == 1  # the same view of the same tensor
    assert sites.once_per_keys(owner, keys[:, 1:], derive) == 2  # another view
    assert sites.once_per_keys(owner, keys, derive) == 1  # each view has its own entry
    assert sites.once_per_keys(other_owner, keys, derive) == 3
    keys.mul_(2.0)
    assert sites.once_per_keys(owner, keys, derive) == 4
    with torch.inference_mode():
        frozen = torch.randn(2, 5, 4)
        assert sites.once_per_keys(owner, frozen, derive) == 5
        assert sites.once_per_keys(owner, frozen, derive) == 6


@pytest.mark.parametrize("variant", ["soft", "wc", "lc"])
def test_a_graph_model_runs_under_inference_mode_as_under_no_grad(variant):
    """PyG users evaluate under ``torch.inference_mode()``; the contextual prior's per-keys memo
    and the graph check once read the write count that inference tensors lack."""
    x, edge_index, _ = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig(variant), ObjectiveConfig(), heads=2, hidden=4)
    outputs = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            graph = (x.clone(), edge_index.clone())
            pyro.set_rng_seed(0)
            trace = pyro.poutine.trace(model.model).get_trace(*graph)
            pyro.set_rng_seed(0)
            again = pyro.poutine.trace(model.model).get_trace(*graph)  # the same tensors, memos warm
        outputs.append([trace.nodes[name]["value"] for name in trace.stochastic_nodes])
        assert all(torch.equal(a, b) for a, b in zip(outputs[-1], (again.nodes[name]["value"] for name in again.stochastic_nodes)))
    assert len(outputs[0]) == len(outputs[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
