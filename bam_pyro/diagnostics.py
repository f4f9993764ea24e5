"""ArviZ view of attention draws: named dimensions, summary, ESS, R-hat and HDI; the one pipeline
every task's attention diagnostics run through.

:func:`attention_chains` draws the attention posterior of chosen entries (and the prior's attention
beside each draw) over independent chains with :func:`bam_pyro.predictive.predictive_draws`,
chain c seeded ``seed + c`` (:func:`chain_seeds`; :func:`seeded_chains` for draws of another
kind). :meth:`AttentionDiagnostics.of` turns chains into ArviZ data and their summary, and
:meth:`AttentionDiagnostics.write` writes both with the worst ESS and R-hat. A task only says which
sites and entries it diagnoses and which figures it draws.

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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

import numpy as np
import torch

from .distributed import Engine
from .model import BamModel
from .optional import require
from .predictive import predictive_draws, softmax_probs
from .training import share_seeded
from .validation import whole_number

az = require("arviz", "bam_pyro.diagnostics")
pd = require("pandas", "bam_pyro.diagnostics")
xr = require("xarray", "bam_pyro.diagnostics")

DIMS = ("layer", "head", "query", "key")

#: one chain of attention draws: layer -> weights ``[draw, head, query, key]``, NaN where an entry does not exist
Chain = Mapping[str, np.ndarray]
T = TypeVar("T")


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


# --- the pipeline: chains of draws -> ArviZ data, summary and files --------------------------------


def chain_seeds(seed: int, chains: int) -> list[int]:
    """The seeds of the ``chains`` independent chains of a run seeded ``seed``: chain c uses
    ``seed + c``. One rule for every task, so a run's diagnostics are reproduced from its seed."""
    whole_number("chains", chains)
    return [seed + chain for chain in range(chains)]


def seeded_chains(draw: Callable[[], T], seed: int, chains: int, engine: Optional[Engine] = None) -> list[T]:
    """``draw()`` once per chain, with torch's, NumPy's and Python's RNGs seeded by
    :func:`chain_seeds` (:func:`~bam_pyro.training.seeded`: the caller's RNG states are restored
    afterwards, so drawing diagnostics leaves the rest of a run's randomness as it was). With the
    ``engine`` of several processes, each draws its share of the chains and every process gets them
    all (:meth:`~bam_pyro.distributed.LocalEngine.share`): the chains of one process."""
    return share_seeded(lambda index: draw(), chain_seeds(seed, chains), engine)


def attention_chains(
    bam_model: BamModel,
    inputs: Sequence,
    draws: int,
    *,
    seed: int,
    chains: int,
    layers: Sequence[str],
    select_attention: Callable[[torch.Tensor], torch.Tensor],
    probs_fn: Callable[[Any], torch.Tensor] = softmax_probs,
    chunk_size: int = 100,
    engine: Optional[Engine] = None,
) -> tuple[list[Chain], list[Chain]]:
    """Posterior and prior chains of the attention of ``layers`` (:func:`seeded_chains` of
    :func:`~bam_pyro.predictive.predictive_draws` in eval mode: the attention noise q(S | Phi) alone).

    ``select_attention`` maps a chunk of a layer's weights to ``[draws, head, query, key]``, NaN
    where an entry does not exist (e.g. :func:`gather` for graph neighbourhoods). The prior chains
    hold the prior's location beside each draw, laid out the same and normalized over each query's
    keys: the prior's attention. ``probs_fn`` as in ``predictive_draws``; ``engine`` as in
    :func:`seeded_chains`.
    """

    def draw() -> tuple[Chain, Chain]:
        result = predictive_draws(bam_model, inputs, draws, layers=layers, with_prior=True,
                                  select_attention=select_attention, probs_fn=probs_fn, chunk_size=chunk_size)
        posterior = {layer: w.cpu().numpy() for layer, w in result.attention.items()}
        prior = {layer: (p / p.nansum(-1, keepdim=True)).cpu().numpy() for layer, p in result.prior_location.items()}
        return posterior, prior

    pairs = seeded_chains(draw, seed, chains, engine)
    return [posterior for posterior, _ in pairs], [prior for _, prior in pairs]


@dataclass
class AttentionDiagnostics:
    """The ArviZ data of chains of attention draws and their :func:`attention_summary` (a task may
    add columns to it before writing, e.g. the words its queries and keys stand for)."""

    idata: az.InferenceData
    summary: pd.DataFrame

    @classmethod
    def of(cls, posterior: Sequence[Chain], prior: Optional[Sequence[Chain]] = None, queries: Optional[Sequence] = None,
           key_node: Optional[np.ndarray] = None) -> AttentionDiagnostics:
        """See :func:`attention_inference_data` for the arguments."""
        idata = attention_inference_data(posterior, queries=queries, key_node=key_node, prior_chains=prior)
        return cls(idata, attention_summary(idata))

    def info(self) -> dict[str, Any]:
        """Chains, draws per chain, the entries summarized and excluded, the worst ESS and R-hat."""
        attention = self.idata.posterior["attention"]
        return {"chains": int(attention.sizes["chain"]), "draws": int(attention.sizes["draw"]),
                "queries": [_plain(q) for q in attention.coords["query"].values], "entries": len(self.summary),
                "constant_entries": self.summary.attrs["constant_entries"],
                "ess_bulk_min": float(self.summary["ess_bulk"].min()), "r_hat_max": float(self.summary["r_hat"].max())}

    def write(self, folder: Path, **details: Any) -> dict[str, Path]:
        """``attention.nc`` (the ArviZ data), ``attention-summary.csv`` and
        ``attention-diagnostics.json`` (:meth:`info` and the task's ``details``) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = {"draws": folder / "attention.nc", "summary": folder / "attention-summary.csv",
                   "info": folder / "attention-diagnostics.json"}
        self.idata.to_netcdf(written["draws"])
        self.summary.to_csv(written["summary"])
        written["info"].write_text(json.dumps({**self.info(), **details}, indent=1))
        return written


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python value JSON writes."""
    return value.item() if hasattr(value, "item") else value
