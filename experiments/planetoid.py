"""Planetoid citation graphs (Cora, CiteSeer, PubMed) through PyG, from a read-only data root."""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from torch_geometric.data import Data
from torch_geometric.datasets import Planetoid
from torch_geometric.transforms import NormalizeFeatures

from bam_pyro.data import default_cache, require_files, resolve_data_root

NAMES = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
RAW_PARTS = ["x", "tx", "allx", "y", "ty", "ally", "graph", "test.index"]


def load_planetoid(name: str, data_root: Optional[os.PathLike] = None) -> tuple[Data, int, int]:
    """Returns (graph with train/val/test masks, num_features, num_classes).

    Features are row-normalized (each node's bag of words sums to one), as in GAT's preprocessing.
    The raw files are read from ``<root>/planetoid/<Name>/raw`` (or ``<root>/<Name>/raw``); PyG
    writes its processed copy into a user cache, never into the data root.
    """
    key = name.lower()
    if key not in NAMES:
        raise ValueError(f"unknown Planetoid data set {name!r}; expected one of {sorted(NAMES)}")
    pyg_name = NAMES[key]
    root, given = resolve_data_root(data_root)
    if not given:  # no data root anywhere: let PyG download into the cache
        dataset = Planetoid(str(root / "planetoid"), pyg_name, transform=NormalizeFeatures())
        return dataset[0], dataset.num_features, dataset.num_classes
    raw = root / "planetoid" / pyg_name / "raw"
    if not raw.is_dir() and (root / pyg_name / "raw").is_dir():
        raw = root / pyg_name / "raw"
    require_files(raw, [f"ind.{key}.{part}" for part in RAW_PARTS], f"Planetoid {pyg_name}")
    cache = default_cache() / "planetoid" / hashlib.sha1(str(raw).encode()).hexdigest()[:12]
    cache_raw = cache / pyg_name / "raw"
    cache_raw.mkdir(parents=True, exist_ok=True)
    for part in RAW_PARTS:
        link = cache_raw / f"ind.{key}.{part}"
        if not link.exists():
            link.symlink_to(raw / f"ind.{key}.{part}")
    dataset = Planetoid(str(cache), pyg_name, transform=NormalizeFeatures())
    return dataset[0], dataset.num_features, dataset.num_classes
