"""Planetoid citation graphs (Cora, CiteSeer, PubMed) through PyG, from a read-only data root."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

from torch_geometric.data import Data
from torch_geometric.datasets import Planetoid
from torch_geometric.transforms import NormalizeFeatures

from experiments.data_root import default_cache, require_files, resolve_data_root
from bam_pyro.pyg import validate_graph

NAMES = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
RAW_PARTS = ["x", "tx", "allx", "y", "ty", "ally", "graph", "test.index"]


def load_planetoid(name: str, data_root: Optional[os.PathLike] = None) -> tuple[Data, int, int]:
    """Returns (graph with train/val/test masks, num_features, num_classes).

    Features are row-normalized (each node's bag of words sums to one), as in GAT's preprocessing;
    NaN or inf in the raw features is an error naming the nodes (checked before the normalization,
    whose shift by the global minimum would spread one NaN to every node). The raw files are read
    from ``<root>/planetoid/<Name>/raw`` (or ``<root>/<Name>/raw``); PyG writes its processed copy
    into a user cache, never into the data root, under a key that changes with the raw files.
    """
    key = name.lower()
    if key not in NAMES:
        raise ValueError(f"unknown Planetoid data set {name!r}; expected one of {sorted(NAMES)}")
    pyg_name = NAMES[key]
    root, given = resolve_data_root(data_root)
    if not given:  # no data root anywhere: let PyG download into the cache
        dataset = Planetoid(str(root / "planetoid"), pyg_name, transform=NormalizeFeatures())
    else:
        raw = root / "planetoid" / pyg_name / "raw"
        if not raw.is_dir() and (root / pyg_name / "raw").is_dir():
            raw = root / pyg_name / "raw"
        names = [f"ind.{key}.{part}" for part in RAW_PARTS]
        require_files(raw, names, f"Planetoid {pyg_name}")
        cache = default_cache() / "planetoid" / raw_files_key(raw, names)
        cache_raw = cache / pyg_name / "raw"
        cache_raw.mkdir(parents=True, exist_ok=True)
        for name in names:
            link = cache_raw / name
            if not link.exists():
                link.symlink_to(raw / name)
        dataset = Planetoid(str(cache), pyg_name, transform=NormalizeFeatures())
    unnormalized = dataset.get(0)  # without the transform
    validate_graph(unnormalized.x, unnormalized.edge_index)
    return dataset[0], dataset.num_features, dataset.num_classes


def raw_files_key(raw: Path, names: list[str]) -> str:
    """Twelve hex digits of the raw folder's path and its files' sizes and modification times.
    PyG reprocesses only when its processed copy is missing, so the copy's folder is named by
    this key: raw files changed (e.g. fixed) get a new copy instead of the stale one."""
    stats = [(raw / name).stat() for name in names]
    text = "|".join([str(raw), *(f"{name}:{s.st_size}:{s.st_mtime_ns}" for name, s in zip(names, stats))])
    return hashlib.sha1(text.encode()).hexdigest()[:12]
