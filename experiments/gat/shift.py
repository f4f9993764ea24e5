"""The graph shifts of the uncertainty-under-shift tables: classes left out of training, and test
nodes' words flipped.

- **Left-out classes** (Graph Posterior Network's leave-out-class setting, Stadler et al. 2021): the
  last ``n`` classes' nodes keep their place in the graph but lose their labels, in training and in
  validation (early stopping must not see them either); the network predicts the kept classes
  only. The in-distribution set is the test nodes of the kept classes, the out-of-distribution set
  the test nodes of the left-out ones. :data:`GPN_LEFT_OUT` is GPN's choice per data set.
- **Feature shift**: each test node's binary bag of words has every entry flipped (0 to 1, 1 to 0)
  with probability ``p``, from a fixed seed, then is row-normalized again as the loader does; the
  graph and the other nodes' features stay as they were.
"""

from __future__ import annotations

import torch
from torch_geometric.data import Data

#: classes GPN leaves out, the last ones: Cora's last 3 of 7, CiteSeer's last 2 of 6
GPN_LEFT_OUT = {"cora": 3, "citeseer": 2}
#: flip probabilities of the feature shift, and the seed of the flips
FLIP_STRENGTHS = (0.01, 0.05)
FLIP_SEED = 1234


def leave_out_classes(data: Data, num_features: int, num_classes: int, left_out: int) -> tuple[Data, int, int]:
    """``(data, num_features, num_classes)`` with the last ``left_out`` classes hidden: train, val and
    test masks keep only the other classes' nodes, ``ood_mask`` holds the left-out classes' test
    nodes, and the classifier gets ``num_classes - left_out`` outputs."""
    if not 0 < left_out < num_classes - 1:
        raise ValueError(f"left_out must lie in 1..{num_classes - 2} (at least 2 classes kept of {num_classes}), got {left_out}")
    kept = num_classes - left_out
    known = data.y < kept
    data = data.clone()
    data.ood_mask = data.test_mask & ~known
    for name in ("train_mask", "val_mask", "test_mask"):
        data[name] = data[name] & known
    return data, num_features, kept


def flip_features(x: torch.Tensor, nodes: torch.Tensor, p: float, seed: int = FLIP_SEED) -> torch.Tensor:
    """A copy of ``x`` (row-normalized bags of words) whose rows ``nodes`` have each word's presence
    flipped with probability ``p`` (a generator seeded by ``seed``), then row-normalized again; a
    row left with no word stays zero."""
    if not 0 <= p <= 1:
        raise ValueError(f"flip probability must lie in [0, 1], got {p}")
    generator = torch.Generator().manual_seed(seed)
    rows = (x[nodes] > 0).float()
    flips = torch.rand(rows.shape, generator=generator) < p
    rows = torch.where(flips.to(rows.device), 1 - rows, rows)
    shifted = x.clone()
    shifted[nodes] = rows / rows.sum(-1, keepdim=True).clamp(min=1)
    return shifted
