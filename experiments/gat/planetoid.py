"""Planetoid citation graphs (Cora, CiteSeer, PubMed) through PyG, from a read-only data root.

No code runs from a data file. PyG reads Planetoid's raw ``ind.*`` files with ``pickle.load``, and
its processed cache with ``torch.load``, retried with ``weights_only=False`` when the safe load
fails. Here the raw files are first read by an unpickler that admits only what the format holds
(NumPy arrays, SciPy CSR matrices, lists, dicts and a defaultdict) and written again from what it
read, so PyG's own processing reads only those; the processed cache is read with
``weights_only=True`` and rebuilt from the raw files when that fails. A refused or unreadable raw
file is a ``ValueError`` naming it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch_geometric.data import Data
from torch_geometric.datasets import Planetoid
from torch_geometric.transforms import NormalizeFeatures

from experiments.data_root import default_cache, require_files, resolve_data_root
from bam_pyro.pyg import validate_graph

NAMES = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
RAW_PARTS = ["x", "tx", "allx", "y", "ty", "ally", "graph", "test.index"]
#: the raw parts that are pickles (``test.index`` is text)
PICKLED_PARTS = [part for part in RAW_PARTS if part != "test.index"]
#: every global a Planetoid pickle needs (module as pickled, Python 2's names included), and no other
ADMITTED = {
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("scipy.sparse.csr", "csr_matrix"), ("scipy.sparse._csr", "csr_matrix"), ("scipy.sparse", "csr_matrix"),
    ("collections", "defaultdict"),
    ("__builtin__", "list"), ("builtins", "list"), ("__builtin__", "dict"), ("builtins", "dict"),
}


class _PlanetoidUnpickler(pickle.Unpickler):
    """An unpickler that builds only :data:`ADMITTED` globals: a crafted file's payload is refused
    before it runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ADMITTED:
            raise pickle.UnpicklingError(f"refused {module}.{name}: the Planetoid format holds only arrays, sparse "
                                         "matrices, lists and dicts (a crafted file could run code)")
        return super().find_class(module, name)


def read_raw_part(path: Path) -> Any:
    """One pickled raw file, read by :class:`_PlanetoidUnpickler`; ``ValueError`` naming the file
    (the data root's, where ``path`` links to it) if it holds anything else, is cut short or is not
    a pickle."""
    path = path.resolve()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # scipy.sparse.csr, numpy.core: the names pickled in 2017
        try:
            with open(path, "rb") as file:
                content = _PlanetoidUnpickler(file, encoding="latin1").load()
        except pickle.UnpicklingError as error:
            text = str(error)
            raise ValueError(f"{path}: {text if text.startswith('refused') else f'not a Planetoid file ({text})'}") from None
        except (EOFError, ValueError, TypeError, AttributeError, IndexError) as error:  # cut short, or garbled opcodes
            raise ValueError(f"{path}: not a Planetoid file ({type(error).__name__}: {error or 'ran out of input'})") from None
    if path.name.endswith(".graph") and not isinstance(content, dict):
        raise ValueError(f"{path}: not a Planetoid graph (a {type(content).__name__}, not a dict of neighbour lists)")
    return content


class SafePlanetoid(Planetoid):
    """PyG's :class:`~torch_geometric.datasets.Planetoid`, with its raw files read by
    :func:`read_raw_part` before PyG's processing and its processed cache read safely (module doc)."""

    def process(self) -> None:
        for part in PICKLED_PARTS:
            path = Path(self.raw_dir) / f"ind.{self.name.lower()}.{part}"
            content = read_raw_part(path)
            partial = path.with_name(f".{path.name}.{os.getpid()}")
            with open(partial, "wb") as file:
                pickle.dump(content, file, protocol=4)  # before 5 (its arrays need other globals), after 2 (bytes by a codec)
            os.replace(partial, path)  # in the cache, over the link to the data root: what PyG reads is what we read
        try:
            super().process()
        except (ValueError, RuntimeError, IndexError, TypeError) as error:
            raise ValueError(f"{self.raw_dir}: the Planetoid files do not fit together ({error})") from None

    def load(self, path: str, data_cls: type = Data) -> None:
        """PyG's :meth:`~torch_geometric.data.InMemoryDataset.load`, but with
        ``torch.load(weights_only=True)`` only (PyG's retries unsafely); a file that fails it is
        rebuilt from the raw files."""
        try:
            stored = _safe_load(path)
        except Exception as error:  # torch.load's errors on a broken or crafted file: UnpicklingError, RuntimeError...
            warnings.warn(f"{path}: not a safe PyG cache ({str(error).strip().splitlines()[0]}); rebuilt from the raw files",
                          stacklevel=2)
            os.remove(path)
            self.process()
            stored = _safe_load(path)
        data, self.slices, data_cls = stored if len(stored) == 3 else (*stored, data_cls)  # PyG's two layouts
        self.data = data_cls.from_dict(data) if isinstance(data, dict) else data


def _safe_load(path: str) -> tuple:
    with torch.serialization.safe_globals([Data]):  # the data class PyG stores beside the tensors
        stored = torch.load(path, weights_only=True)
    if not isinstance(stored, tuple) or len(stored) not in (2, 3):
        raise ValueError(f"not PyG's (data, slices[, class]) but a {type(stored).__name__}")
    return stored


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
        dataset = SafePlanetoid(str(root / "planetoid"), pyg_name, transform=NormalizeFeatures())
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
        dataset = SafePlanetoid(str(cache), pyg_name, transform=NormalizeFeatures())
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
