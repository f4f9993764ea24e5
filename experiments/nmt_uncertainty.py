"""The posterior of a translation model's attention for a few sentences: a figure and ArviZ diagnostics.

Draws come from ``pyro.infer.Predictive`` over the model and its guide, vectorized over draws:

- BAM (:func:`attention_draws`, through :func:`bam_pyro.predictive.predictive_draws`): the
  attention of all target steps is one sample site after the recurrent loop, so a chunk of draws is
  one pass through that call and the output layer; the prior beside it is the contextual prior's
  mean. Each draw is teacher forced on the reference translation: the attention posterior given the
  source and the target prefix of every step.
- Latent alignments (:func:`alignment_draws`, :mod:`bam_pyro.alignment`): for variational
  attention (``va-*``) from q(z | x, y), the inference network reading the whole reference; for the
  models without one (``exact``, ``hard``, ``hard-enum``) from the model's own exact posterior
  p(z_j | x, y_<=j), proportional to p(z_j | x, y_<j) p(y_j | x, y_<j, z_j)
  (``LatentAlignmentModel.posterior_alignments``). One-hot for the categorical variants, so
  that their mean estimates the posterior; Dirichlet weights for ``va-relaxed``. The prior beside
  it is the model's attention p(z_j | x, y_<j).

Written into ``folder`` (where the other tasks write theirs):

- ``figures/attention.png``: for the first sentence, the posterior mean of the weights (target
  piece x source piece), their posterior standard deviation, and the prior's attention (BAM: the
  contextual prior's Psi, the same for every target step; latent alignments: the model's
  attention, step by step): how the data move each step's attention away from its prior (the
  paper's Figure 1, for translation);
- ``diagnostics/attention.nc``: the draws of every valid entry of the chosen sentences as ArviZ
  data, over independent chains of draws (:mod:`bam_pyro.diagnostics`), and
  ``diagnostics/attention-summary.csv``, their ``az.summary`` (mean, sd, HDI, ESS, R-hat).

A training run writes them for the first validation sentences. For sentences of your choosing, of
a finished run (the first one drawn; the target is the reference, or for ``--source`` the given
``--target`` or else the model's own translation)::

    python -m experiments.nmt_uncertainty runs/nmt/runs/multi30k-wc-seed0 --split test --sentences 17
    python -m experiments.nmt_uncertainty runs/nmt/runs/multi30k-wc-seed0 --source "Zwei Hunde spielen im Schnee."
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from pyro.infer import Predictive

from bam_pyro.diagnostics import attention_inference_data, attention_summary
from analysis.plots import plt, save_figure
from bam_pyro import BamModel
from bam_pyro.predictive import predictive_draws
from experiments.multi30k import (BOS, EOS, EncodedSplit, Multi30k, ParallelBatch, SentencePairs, check_pairs,
                                  encode_split, make_batch)
from models.decoding import beam_search
from bam_pyro.alignment import ALIGNMENT, LatentAlignmentModel, guide_for, masked_scores

#: validation sentences whose attention is drawn (the first ones of the file)
SENTENCES = (0, 1, 2)
CHAINS = 2


def reference_probability(batch: ParallelBatch):
    """``probs_fn`` of the draws: per target step, (p(reference piece), 1 - p), a 2-class
    distribution, which keeps each draw's record small (the full vocabulary would be 8k classes)."""

    def probs(logits: torch.Tensor) -> torch.Tensor:
        log_p = logits.log_softmax(-1)
        target = batch.tgt_out.expand(*log_p.shape[:-1]).unsqueeze(-1)
        p = log_p.gather(-1, target).squeeze(-1).exp()
        return torch.stack([p, 1 - p], dim=-1).flatten(-3, -2)

    return probs


def valid_entries(batch: ParallelBatch) -> np.ndarray:
    """``[B, T, S]``: True where a real target step meets a real source piece."""
    return (batch.tgt_mask[:, :, None] & batch.src_mask[:, None, :]).cpu().numpy()


def attention_draws(model: BamModel, batch: ParallelBatch, draws: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Posterior attention ``[draws, B, T, S]`` and the prior's attention ``[B, T, S]`` (NaN at
    padded entries), with their own RNG stream (the caller's is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        result = predictive_draws(model, batch.inputs, draws, layers=["attention"], with_prior=True,
                                  probs_fn=reference_probability(batch), chunk_size=min(draws, 50))
    valid = valid_entries(batch)
    posterior = result.attention["attention"].squeeze(-3).cpu().numpy()
    location = result.prior_location["attention"][0].squeeze(-3).cpu().numpy()
    location = np.where(batch.src_mask[:, None, :].cpu().numpy(), location, 0.0)
    prior = location / location.sum(-1, keepdims=True)  # the prior's mean, normalized over each step's keys
    return np.where(valid, posterior, np.nan), np.where(valid, prior, np.nan)


def alignment_draws(model: LatentAlignmentModel, batch: ParallelBatch, draws: int,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Posterior alignments ``[draws, B, T, S]`` (see module doc: q(z | x, y) of the inference
    network, else the model's exact posterior) and the model's attention p(z | x, y_<j) ``[B, T, S]``
    (NaN at padded entries), with their own RNG stream."""
    args, kwargs = batch.model_args
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
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
    valid = valid_entries(batch)
    return np.where(valid, posterior.cpu().numpy(), np.nan), np.where(valid, prior.cpu().numpy(), np.nan)


def pieces(data: Multi30k, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [data.bpe.id_to_piece(int(i)) for i in ids[mask]]


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


def attention_uncertainty(model: BamModel, data: Multi30k, folder: Path, draws: int = 100, seed: int = 0,
                          sentences: Sequence[int] = SENTENCES, chains: int = CHAINS,
                          split: Optional[EncodedSplit] = None) -> dict[str, Path]:
    """Draw the attention posterior of ``sentences`` of ``split`` (default: validation) and write
    the figure of the first and the summary of all (see module doc). Returns the written paths."""
    split = data.val if split is None else split
    for sentence in sentences:
        if not 0 <= sentence < len(split):
            raise ValueError(f"sentence {sentence} is out of range: the split has {len(split)} sentences (0-{len(split) - 1})")
    batch = split.batch(list(sentences))
    draw = alignment_draws if isinstance(model, LatentAlignmentModel) else attention_draws
    runs = [draw(model, batch, draws, seed=1000 * seed + chain) for chain in range(chains)]
    prior = runs[0][1]
    folder = Path(folder)
    written = {}
    source, target = pieces(data, batch.src[0], batch.src_mask[0]), pieces(data, batch.tgt_out[0], batch.tgt_mask[0])
    first = np.concatenate([w[:, 0, : len(target), : len(source)] for w, _ in runs])  # the first sentence's entries
    written["figure"] = heatmap(first.mean(0), first.std(0), prior[0], source, target,
                                folder / "figures" / "attention.png")
    queries = [f"{s}:{j}" for s in sentences for j in range(batch.tgt_in.size(1))]
    as_maps = lambda a: {"attention": a.reshape(a.shape[0], 1, -1, a.shape[-1])}  # noqa: E731  [draw, head, query, key]
    idata = attention_inference_data([as_maps(w) for w, _ in runs], queries=queries,
                                     prior_chains=[as_maps(np.broadcast_to(p, w.shape)) for w, p in runs])
    written["draws"] = folder / "diagnostics" / "attention.nc"
    written["draws"].parent.mkdir(parents=True, exist_ok=True)
    idata.to_netcdf(written["draws"])
    written["summary"] = folder / "diagnostics" / "attention-summary.csv"
    attention_summary(idata).to_csv(written["summary"])
    return written


# --- command line: sentences of your choosing, of a finished run -----------------------------


def chosen_sentences(run_dir: Path, split_name: str, sentences: Sequence[int], source: Optional[str],
                     target: Optional[str], data_root: Optional[str], draws: int, chains: int, seed: int,
                     out: Optional[Path] = None) -> dict[str, Path]:
    """Load the finished run in ``run_dir``, draw the attention posterior of the chosen sentences
    (see module doc) into ``out`` (default: ``<run>/attention-<split>-<sentence>`` or
    ``<run>/attention-source``) and print the first one's source, target and translation."""
    # imported here: the task imports this module for its runs (and a run's process may hold an older runner)
    from experiments.nmt import TASK, has_attention_posterior
    from experiments.runner import load_trained

    settings, data, model = load_trained(TASK, run_dir, data_root)
    if not has_attention_posterior(settings):
        raise ValueError(f"{run_dir}: variant {settings.variant!r} has no attention posterior of its own to draw "
                         "(soft: fixed weights; nokl: no prior to set it against)")

    def translation(batch: ParallelBatch) -> str:
        return data.decode(beam_search(model, batch.src, batch.src_mask, BOS, EOS, settings.beam_size,
                                       settings.length_penalty)[0])

    if source is None:
        split, label = getattr(data, split_name), f"{split_name}-{sentences[0]}"
    else:
        if target is None:
            target = translation(make_batch([np.asarray(data.bpe.encode(source), dtype=np.int64)], [np.zeros(0, np.int64)]))
            if not target.strip():
                raise ValueError("the model translates --source to nothing (EOS first): pass the --target to draw along")
        split = encode_split(check_pairs(SentencePairs([source], [target]), "--source/--target"), data.bpe)
        sentences, label = (0,), "source"
    folder = Path(out) if out is not None else Path(run_dir) / f"attention-{label}"
    written = attention_uncertainty(model, data, folder, draws=draws, seed=seed, sentences=sentences, chains=chains,
                                    split=split)
    first = split.batch([sentences[0]])
    print(f"source:      {data.decode(first.src[0][first.src_mask[0]].tolist())}")
    print(f"target:      {data.decode(first.tgt_out[0][first.tgt_mask[0]][:-1].tolist())} (the attention is drawn along it)")
    print(f"translation: {translation(first)}")
    for name, path in written.items():
        print(f"{name}: {path}")
    return written


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(prog="python -m experiments.nmt_uncertainty", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the folder of a finished translation run, <out>/runs/<run>")
    parser.add_argument("--split", choices=("val", "test"), default="val", help="the split the sentences are from")
    parser.add_argument("--sentences", type=int, nargs="+", default=list(SENTENCES),
                        help="their numbers in the split (from 0, file order); the figure shows the first")
    parser.add_argument("--source", help="a German sentence of your own instead")
    parser.add_argument("--target", help="with --source: the English target the attention is drawn along "
                                         "(default: the model's translation)")
    parser.add_argument("--draws", type=int, default=100, help="posterior draws per chain (at least 2)")
    parser.add_argument("--chains", type=int, default=CHAINS, help="independent chains of draws (for R-hat)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="output folder (default: a folder in the run's)")
    parser.add_argument("--data-root", default=None, help="data root (default: $BAM_DATA, ../shared/data, or a download cache)")
    args = parser.parse_args(argv)
    if args.target is not None and args.source is None:
        parser.error("--target goes with --source")
    if args.draws < 2 or args.chains < 1:
        parser.error("--draws must be at least 2 and --chains at least 1")
    try:
        return chosen_sentences(args.run, args.split, args.sentences, args.source, args.target, args.data_root,
                                args.draws, args.chains, args.seed, args.out)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main()
