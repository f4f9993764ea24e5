"""ArviZ view of attention draws: named dimensions, summary, ESS, R-hat and HDI.

Attention draws become one posterior variable ``attention`` with dims
``(chain, draw, layer, head, query, key)``: a chain is an independent run of the sampler
(its own seed). Layers with fewer heads, and queries with fewer keys (a graph node's
neighbourhood), are padded with NaN; ``constant_data`` holds ``valid`` (which entries exist)
and ``key_node`` (for graphs, the source node of each neighbour slot; -1 when padded).

The draws come from the amortized variational posterior, so they are independent: ESS is close
to the number of draws and R-hat close to 1 by construction. They check the sampling code
(seeding, chunking), not a Markov chain's mixing. Entries that never vary (a node whose only
neighbour is itself has weight 1) have no defined R-hat; they are excluded and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from .optional import require

az = require("arviz", "bam_pyro.diagnostics")
pd = require("pandas", "bam_pyro.diagnostics")
xr = require("xarray", "bam_pyro.diagnostics")

DIMS = ("layer", "head", "query", "key")


@dataclass
class Neighbourhoods:
    """The incoming edges of chosen nodes, one row per node, padded with -1."""

    nodes: np.ndarray  # [queries]
    edges: np.ndarray  # [queries, max_degree] edge ids into the attention entries
    sources: np.ndarray  # [queries, max_degree] source node of each edge

    @property
    def valid(self) -> np.ndarray:
        return self.edges >= 0


def neighbourhoods(edge_index, nodes: Sequence[int]) -> Neighbourhoods:
    """Incoming edges (row 1 = target) of ``nodes`` in ``edge_index``, the edge list the
    attention entries are laid out on (for GAT: with self-loops added)."""
    edge_index = np.asarray(edge_index)
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must have shape [2, edges], got {edge_index.shape}")
    nodes = np.asarray(nodes, dtype=int).reshape(-1)
    rows = [np.flatnonzero(edge_index[1] == n) for n in nodes]
    if any(r.size == 0 for r in rows):
        raise ValueError(f"nodes without incoming edges: {nodes[[r.size == 0 for r in rows]].tolist()}")
    width = max(r.size for r in rows)
    edges = np.full((nodes.size, width), -1)
    for i, r in enumerate(rows):
        edges[i, : r.size] = r
    sources = np.where(edges >= 0, edge_index[0][edges.clip(min=0)], -1)
    return Neighbourhoods(nodes, edges, sources)


def gather(weights, hoods: Neighbourhoods) -> torch.Tensor:
    """Edge weights ``[draws, edges, heads]`` -> ``[draws, heads, query, key]``, NaN padded.
    Cheap enough to run on each chunk of draws (``predictive_draws(select_attention=...)``)."""
    w = torch.as_tensor(weights)
    if w.dim() != 3:
        raise ValueError(f"edge weights must have shape [draws, edges, heads], got {tuple(w.shape)}")
    edges = torch.as_tensor(hoods.edges)
    out = w[:, edges.clamp_min(0)].to(torch.float64)  # [draws, query, key, heads]
    out[:, ~torch.as_tensor(hoods.valid)] = float("nan")
    return out.permute(0, 3, 1, 2)


def _stack(chains: Sequence[Mapping[str, np.ndarray]]) -> tuple[list[str], np.ndarray]:
    """Chains of per-layer draws -> (layers, array [chain, draw, layer, head, query, key])."""
    if not chains:
        raise ValueError("need at least one chain")
    layers = list(chains[0])
    if not layers or any(list(c) != layers for c in chains):
        raise ValueError("every chain must hold the same, non-empty list of layers")
    draws, _, nq, nk = np.asarray(chains[0][layers[0]]).shape
    heads = max(np.asarray(chains[0][name]).shape[1] for name in layers)
    values = np.full((len(chains), draws, len(layers), heads, nq, nk), np.nan)
    for c, chain in enumerate(chains):
        for l, name in enumerate(layers):
            w = np.asarray(chain[name], dtype=float)
            if w.ndim != 4 or w.shape[0] != draws or w.shape[2:] != (nq, nk):
                raise ValueError(f"chain {c}, layer {name!r}: expected [{draws}, heads, {nq}, {nk}], got {w.shape}")
            values[c, :, l, : w.shape[1]] = w
    return layers, values


def attention_inference_data(
    chains: Sequence[Mapping[str, np.ndarray]],
    queries: Sequence | None = None,
    key_node: np.ndarray | None = None,
    prior_chains: Sequence[Mapping[str, np.ndarray]] | None = None,
) -> az.InferenceData:
    """``chains``: one mapping per chain, layer name -> draws ``[draw, head, query, key]`` with
    NaN where an entry does not exist. All chains need the same layers and shapes.
    ``prior_chains``, laid out the same way, fill the ``prior`` group."""
    layers, values = _stack(chains)
    groups = {"posterior": {"attention": values}}
    if prior_chains is not None:
        prior_layers, prior = _stack(prior_chains)
        if prior_layers != layers or prior.shape[2:] != values.shape[2:]:
            raise ValueError("prior and posterior draws must have the same layers and entries")
        groups["prior"] = {"attention": prior}
    valid = ~np.isnan(values).any(axis=(0, 1))
    nq, nk = values.shape[-2:]
    coords = {"layer": layers, "head": np.arange(values.shape[3]), "query": list(queries) if queries is not None else np.arange(nq), "key": np.arange(nk)}
    constant = {"valid": valid}
    dims = {"attention": list(DIMS), "valid": list(DIMS)}
    if key_node is not None:
        constant["key_node"] = np.asarray(key_node)
        dims["key_node"] = ["query", "key"]
    return az.from_dict(**groups, constant_data=constant, dims=dims, coords=coords)


def attention_summary(idata: az.InferenceData, hdi_prob: float = 0.94) -> pd.DataFrame:
    """``az.summary`` (mean, sd, HDI, ESS, R-hat) of every existing, varying attention entry,
    indexed by (layer, head, query, key). ``attrs["constant_entries"]`` counts the excluded
    entries that never vary."""
    attention = idata.posterior["attention"].transpose("chain", "draw", *DIMS)
    values = attention.values.reshape(attention.shape[0], attention.shape[1], -1)
    valid = idata.constant_data["valid"].transpose(*DIMS).values.reshape(-1)
    varying = valid.copy()
    varying[valid] = np.ptp(values[:, :, valid], axis=(0, 1)) > 0
    keep = np.flatnonzero(varying)
    dataset = xr.Dataset({"w": (("chain", "draw", "entry"), values[:, :, keep])})
    summary = az.summary(dataset, hdi_prob=hdi_prob)
    index = pd.MultiIndex.from_arrays(
        [np.asarray(attention.coords[d].values)[i] for d, i in zip(DIMS, np.unravel_index(keep, attention.shape[2:]))],
        names=DIMS,
    )
    summary.index = index
    if "key_node" in idata.constant_data:
        nodes = idata.constant_data["key_node"].transpose("query", "key").values
        q, k = np.unravel_index(keep, attention.shape[2:])[2:]
        summary.insert(0, "key_node", nodes[q, k])
    summary.attrs["constant_entries"] = int((valid & ~varying).sum())
    return summary
