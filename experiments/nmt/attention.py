"""The posterior of a translation model's attention for a few sentences: a figure and ArviZ
diagnostics, through the pipeline every task shares (:mod:`bam_pyro.diagnostics`).

Draws come from ``pyro.infer.Predictive`` over the model and its guide, vectorized over draws,
over independent chains (chain c seeded ``seed + c``):

- BAM (:func:`bam_pyro.diagnostics.attention_chains`): the attention of all target steps is one
  sample site after the recurrent loop, so a chunk of draws is one pass through that call and the
  output layer; the prior beside it is the contextual prior's mean. Each draw is teacher forced on
  the reference translation: the attention posterior given the source and the target prefix of
  every step.
- Latent alignments (:func:`alignment_draws`, :mod:`bam_pyro.alignment`): for variational
  attention (``va-*``) from q(z | x, y), the inference network reading the whole reference; for the
  models without one (``exact``, ``hard``, ``hard-enum``) from the model's own exact posterior
  p(z_j | x, y_<=j), proportional to p(z_j | x, y_<j) p(y_j | x, y_<j, z_j)
  (``LatentAlignmentModel.posterior_alignments``). One-hot for the categorical variants, so
  that their mean estimates the posterior; Dirichlet weights for ``va-relaxed``. The prior beside
  it is the model's attention p(z_j | x, y_<j).

The entries are laid out as one head whose queries are the target steps of every sentence
(``"<sentence>:<step>"``) and whose keys are the source pieces. Written into ``folder`` (where the
other tasks write theirs):

- ``figures/attention.png``: for the first sentence, the posterior mean of the weights (target
  piece x source piece), their posterior standard deviation, and the prior's attention (BAM: the
  contextual prior's Psi, the same for every target step; latent alignments: the model's
  attention, step by step): how the data move each step's attention away from its prior (the
  paper's Figure 1, for translation);
- ``diagnostics/``: :meth:`bam_pyro.diagnostics.AttentionDiagnostics.write` of every valid entry
  of the chosen sentences (``attention.nc``, ``attention-summary.csv``, ``attention-diagnostics.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from pyro.infer import Predictive

from analysis.plots import plt, save_figure
from bam_pyro import BamModel
from bam_pyro.alignment import ALIGNMENT, LatentAlignmentModel, guide_for, masked_scores
from bam_pyro.diagnostics import AttentionDiagnostics, Chain, attention_chains, seeded_chains
from bam_pyro.distributed import Engine
from experiments.nmt.multi30k import EncodedSplit, Multi30k, ParallelBatch
from experiments.runner import model_device

#: validation sentences whose attention is drawn (the first ones of the file)
SENTENCES = (0, 1, 2)
CHAINS = 2
#: the attention site of :class:`models.nmt.Seq2Seq` (one layer, all target steps)
SITE = "attention"


def reference_probability(batch: ParallelBatch) -> Callable[[torch.Tensor], torch.Tensor]:
    """``probs_fn`` of the draws: per target step, (p(reference piece), 1 - p), a 2-class
    distribution, which keeps each draw's record small (the full vocabulary would be 8k classes)."""

    def probs(logits: torch.Tensor) -> torch.Tensor:
        log_p = logits.log_softmax(-1)
        target = batch.tgt_out.expand(*log_p.shape[:-1]).unsqueeze(-1)
        p = log_p.gather(-1, target).squeeze(-1).exp()
        return torch.stack([p, 1 - p], dim=-1).flatten(-3, -2)

    return probs


def valid_entries(batch: ParallelBatch) -> torch.Tensor:
    """``[B, T, S]``: True where a real target step meets a real source piece."""
    return batch.tgt_mask[:, :, None] & batch.src_mask[:, None, :]


def as_entries(weights: torch.Tensor, batch: ParallelBatch) -> torch.Tensor:
    """Weights ``[draws, B, T, S]`` (or ``[draws, B, 1, T, S]``, the site's head) -> ``[draws, 1,
    B * T, S]``, NaN at padded entries: the layout of :mod:`bam_pyro.diagnostics`."""
    weights = weights.reshape(weights.shape[0], *valid_entries(batch).shape).double()
    weights = weights.masked_fill(~valid_entries(batch), float("nan"))
    return weights.reshape(weights.shape[0], 1, -1, weights.shape[-1])


def as_sentences(entries: np.ndarray, batch: ParallelBatch) -> np.ndarray:
    """The inverse of :func:`as_entries`: ``[draws, 1, B * T, S]`` -> ``[draws, B, T, S]``."""
    return entries.reshape(entries.shape[0], *valid_entries(batch).shape)


def alignment_draws(model: LatentAlignmentModel, batch: ParallelBatch, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior alignments ``[draws, B, T, S]`` (see module doc: q(z | x, y) of the inference
    network, else the model's exact posterior) and the model's attention p(z | x, y_<j) ``[B, T, S]``,
    from the global RNG."""
    args, kwargs = batch.model_args
    with torch.no_grad():
        if model.spec.guide == "inference":
            predictive = Predictive(model.model, guide=guide_for(model), num_samples=draws, parallel=True,
                                    return_sites=[ALIGNMENT])
            posterior = predictive(*args, **kwargs)[ALIGNMENT]
        else:
            posterior = model.posterior_alignments(draws, *args, **kwargs)
        if not model.spec.relaxed:
            posterior = torch.nn.functional.one_hot(posterior, batch.src.size(1)).float()
        memory = model.network.encode(batch.src, batch.src_mask)
        scores = model.network.decoder_states(memory, batch.tgt_in).scores
        prior = masked_scores(scores, memory.mask.unsqueeze(-2)).softmax(-1)
    return posterior, prior


def posterior_chains(model: BamModel | LatentAlignmentModel, batch: ParallelBatch, draws: int, seed: int,
                     chains: int, engine: Optional[Engine] = None) -> tuple[list[Chain], list[Chain]]:
    """Posterior and prior chains of the batch's attention (see module doc), laid out by :func:`as_entries`;
    each process of ``engine`` draws its share of the chains (:func:`~bam_pyro.diagnostics.seeded_chains`)."""
    if isinstance(model, LatentAlignmentModel):
        def chain() -> tuple[Chain, Chain]:  # NumPy arrays: what a process hands the others
            posterior, prior = alignment_draws(model, batch, draws)
            return ({SITE: as_entries(posterior, batch).cpu().numpy()},
                    {SITE: as_entries(prior.expand_as(posterior), batch).cpu().numpy()})

        pairs = seeded_chains(chain, seed, chains, engine)
        return [posterior for posterior, _ in pairs], [prior for _, prior in pairs]
    return attention_chains(model, batch.inputs, draws, seed=seed, chains=chains, layers=[SITE],
                            select_attention=lambda weights: as_entries(weights, batch),
                            probs_fn=reference_probability(batch), chunk_size=min(draws, 50), engine=engine)


def heatmap(mean: np.ndarray, spread: np.ndarray, prior: np.ndarray, source: list[str], target: list[str], path: Path) -> Path:
    """Posterior mean, posterior sd and prior mean of one sentence's attention, side by side (the
    two means on one colour scale)."""
    rows, cols = len(target), len(source)
    mean, spread, prior = mean[:rows, :cols], spread[:rows, :cols], prior[:rows, :cols]
    top = max(mean.max(), prior.max())
    fig, axes = plt.subplots(1, 3, figsize=(3 * (0.35 * cols + 1.5), 0.35 * rows + 1.8), sharey=True)
    panels = (("posterior mean", mean, "Blues", top), ("posterior sd", spread, "Oranges", spread.max()),
              ("prior mean", prior, "Blues", top))
    for ax, (title, values, cmap, vmax) in zip(axes, panels):
        image = ax.imshow(values, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(cols), source, rotation=90, fontsize=7)
        ax.set_yticks(range(rows), target, fontsize=7)
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)
    axes[0].set_ylabel("target piece (predicted at this step)")
    return save_figure(fig, path)


def pieces(data: Multi30k, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [data.bpe.id_to_piece(int(i)) for i in ids[mask]]


def attention_uncertainty(model: BamModel | LatentAlignmentModel, data: Multi30k, folder: Path, draws: int = 100,
                          seed: int = 0, sentences: Sequence[int] = SENTENCES, chains: int = CHAINS,
                          split: Optional[EncodedSplit] = None, engine: Optional[Engine] = None) -> dict[str, Path]:
    """Draw the attention posterior of ``sentences`` of ``split`` (default: validation) and write
    the figure of the first and the diagnostics of all (see module doc; each process of ``engine`` draws
    its share of the chains). Returns the written paths."""
    split = data.val if split is None else split
    for sentence in sentences:
        if not 0 <= sentence < len(split):
            raise ValueError(f"sentence {sentence} is out of range: the split has {len(split)} sentences (0-{len(split) - 1})")
    batch = split.batch(list(sentences)).to(model_device(model))
    posterior, prior = posterior_chains(model, batch, draws, seed, chains, engine)
    folder = Path(folder)
    source, target = pieces(data, batch.src[0], batch.src_mask[0]), pieces(data, batch.tgt_out[0], batch.tgt_mask[0])
    first = np.concatenate([as_sentences(chain[SITE], batch)[:, 0] for chain in posterior])  # the first sentence
    figure = heatmap(first.mean(0), first.std(0), as_sentences(prior[0][SITE], batch)[0, 0], source, target,
                     folder / "figures" / "attention.png")
    queries = [f"{s}:{j}" for s in sentences for j in range(batch.tgt_in.size(1))]
    written = AttentionDiagnostics.of(posterior, prior, queries=queries).write(folder / "diagnostics")
    return {"figure": figure, **written}
