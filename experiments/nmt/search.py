"""Search error or model error: where the beam search of finished translation runs goes wrong.

Beam search maximizes the length-penalized log-likelihood ``s(y) = log p(y | x) / lp(|y|)`` (EOS
counted in ``|y|``; ``lp`` as the run scored, :func:`models.decoding.length_penalty_factor`). For
each sentence its best output ``y_hat`` is set against the reference ``y`` under that objective:

- a *search error* is a sentence whose reference scores higher, ``s(y) > s(y_hat)``: the search
  missed an output the model prefers;
- otherwise the model prefers its own output: where that differs from the reference, the error
  is the model's (its likelihood ranks a wrong translation first).

A model can lower the perplexity of the references (the mean of ``-log p(y | x)`` per piece) and
still translate worse, when the probability it moves onto the references is spread over many
alternatives, or when beam search finds outputs it rates above them. The per-piece
log-likelihoods of both outputs, the two error shares and the length ratio tell these apart.

For the first ``--sentences`` of a split (file order, the same for every run)::

    python -m experiments.nmt.search runs/nmt/runs/multi30k-soft-seed0 runs/nmt/runs/multi30k-va-sample-seed0

writes ``search.csv`` (one row a sentence and run), ``table.csv`` and ``table.md`` (one row a run)
and ``figures/search.png`` (per run, each sentence's reference score against its output's; points
under the diagonal are search errors) into ``--out`` (default: ``search-<split>`` beside the runs'
``runs`` folder). Each run's sentences are kept in ``<out>/runs`` as they are done: the same command
again, with more runs or after a stop, scores only what is new.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
import sacrebleu
import torch

from analysis.plots import plt, save_figure
from bam_pyro import BamModel
from experiments.nmt.multi30k import BOS, EOS, EncodedSplit, Multi30k
from experiments.nmt.task import TASK
from experiments.records import require_writable_folder
from experiments.runner import load_trained
from models.decoding import beam_hypotheses, length_limits, length_penalty_factor

SENTENCES = 500
BATCH_SIZE = 50


def first_sentences(split: EncodedSplit, count: int) -> EncodedSplit:
    """The first ``count`` pairs of a split, in file order."""
    return EncodedSplit(split.sources[:count], split.targets[:count], split.references[:count])


@torch.no_grad()
def sentence_scores(model: BamModel, data: Multi30k, split: EncodedSplit, beam_size: int, length_penalty: float,
                    batch_size: int = BATCH_SIZE) -> pd.DataFrame:
    """One row a sentence (file order): the reference's and the best beam output's log-likelihood,
    pieces (EOS included) and penalized score, and the output's text."""
    rows: list[dict] = [{} for _ in range(len(split))]
    for indices, batch in split.ordered_batches(batch_size):
        log_probs = model.log_probs(*batch.inputs).gather(-1, batch.tgt_out.unsqueeze(-1)).squeeze(-1)
        reference_log_probs = log_probs.masked_fill(~batch.tgt_mask, 0.0).sum(-1).tolist()
        reference_pieces = batch.tgt_mask.sum(-1).tolist()
        found = beam_hypotheses(model, batch.src, batch.src_mask, BOS, EOS, beam_size, length_penalty)
        limits = length_limits(batch.src_mask)
        for index, log_prob, pieces, hypotheses, limit in zip(indices, reference_log_probs, reference_pieces, found, limits):
            best = hypotheses[0]
            output_pieces = len(best.tokens) + (len(best.tokens) < limit)  # EOS, unless cut at the limit
            penalty = float(length_penalty_factor(torch.tensor(float(pieces)), length_penalty))
            rows[index] = {
                "sentence": int(index),
                "reference_log_prob": log_prob, "reference_pieces": pieces, "reference_score": log_prob / penalty,
                "output_log_prob": best.log_prob, "output_pieces": output_pieces, "output_score": best.score,
                "exact": best.tokens == split.targets[index].tolist(),
                "output": data.decode(best.tokens), "reference": split.references[index],
            }
    return pd.DataFrame(rows)


def run_summary(scores: pd.DataFrame) -> dict[str, float]:
    """A run's figures over its sentences (shares in percent)."""
    search_errors = scores["reference_score"] > scores["output_score"]
    corpus = sacrebleu.corpus_bleu(scores["output"].tolist(), [scores["reference"].tolist()])
    return {
        "sentences": len(scores),
        "bleu": corpus.score,
        "length_ratio": corpus.sys_len / corpus.ref_len,
        "reference_nll_per_piece": -scores["reference_log_prob"].sum() / scores["reference_pieces"].sum(),
        "output_nll_per_piece": -scores["output_log_prob"].sum() / scores["output_pieces"].sum(),
        "search_errors_%": 100 * search_errors.mean(),
        "model_errors_%": 100 * (~search_errors & ~scores["exact"]).mean(),
        "exact_%": 100 * scores["exact"].mean(),
    }


def score_plot(scores: pd.DataFrame, path: Path) -> Path:
    """Per run, each sentence's reference score (x) against its output's (y)."""
    runs = list(dict.fromkeys(scores["run"]))
    fig, axes = plt.subplots(1, len(runs), figsize=(3.6 * len(runs), 3.8), sharex=True, sharey=True, squeeze=False)
    low = float(scores[["reference_score", "output_score"]].min().min())
    for ax, run in zip(axes[0], runs):
        rows = scores[scores["run"] == run]
        missed = rows["reference_score"] > rows["output_score"]
        ax.scatter(rows["reference_score"][~missed], rows["output_score"][~missed], s=6, alpha=0.5, label="model prefers its output")
        ax.scatter(rows["reference_score"][missed], rows["output_score"][missed], s=6, alpha=0.7, color="C3", label="search error")
        ax.plot([low, 0], [low, 0], color="0.5", linewidth=0.8)
        ax.set_title(f"{run}\nsearch errors {100 * missed.mean():.1f}%", fontsize=9)
        ax.set_xlabel("reference: log p(y|x) / lp")
    axes[0][0].set_ylabel("beam output: log p(y_hat|x) / lp")
    axes[0][0].legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)


def run_scores(run_dir: Path, split_name: str, count: int, folder: Path, data_root: Optional[str] = None,
               batch_size: int = BATCH_SIZE) -> pd.DataFrame:
    """:func:`sentence_scores` of one finished run with its own beam settings, the ``run`` and
    ``variant`` in front; kept in ``folder`` and read back from there by a later call (a finished
    run does not change), so a comparison that is stopped resumes from the runs it has done."""
    kept = folder / f"{run_dir.name}-{split_name}-{count}.csv"
    if kept.is_file():
        return pd.read_csv(kept, keep_default_na=False)
    settings, data, model = load_trained(TASK, run_dir, data_root)
    split = first_sentences(getattr(data, split_name), count)
    print(f"{run_dir.name}: {len(split)} {split_name} sentences, beam {settings.beam_size}", flush=True)
    scores = sentence_scores(model, data, split, settings.beam_size, settings.length_penalty, batch_size)
    scores.insert(0, "variant", settings.variant)
    scores.insert(0, "run", run_dir.name)
    folder.mkdir(parents=True, exist_ok=True)
    scores.to_csv(kept.with_suffix(".part"), index=False)
    kept.with_suffix(".part").replace(kept)
    return scores


def compare_runs(run_dirs: Sequence[Path], split_name: str, count: int, out: Path, data_root: Optional[str] = None,
                 batch_size: int = BATCH_SIZE) -> pd.DataFrame:
    """Score every run on the same sentences; write the tables and the figure into ``out``."""
    scored = [run_scores(run_dir, split_name, count, out / "runs", data_root, batch_size) for run_dir in run_dirs]
    table = pd.DataFrame([{"run": s["run"].iloc[0], "variant": s["variant"].iloc[0], **run_summary(s)} for s in scored])
    everything = pd.concat(scored, ignore_index=True)
    everything.to_csv(out / "search.csv", index=False)
    table.to_csv(out / "table.csv", index=False)
    text = table.to_markdown(index=False, floatfmt=".2f")
    (out / "table.md").write_text(text + "\n")
    score_plot(everything, out / "figures" / "search.png")
    print(text)
    return table


def main(argv: Optional[Sequence[str]] = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m experiments.nmt.search", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="folders of finished translation runs, <out>/runs/<run>")
    parser.add_argument("--split", choices=("val", "test"), default="val")
    parser.add_argument("--sentences", type=int, default=SENTENCES, help="how many, from the first (file order)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--out", type=Path, help="output folder (default: search-<split> beside the first run's runs folder)")
    parser.add_argument("--data-root", default=None, help="data root (default: $BAM_DATA, ../shared/data, or a download cache)")
    args = parser.parse_args(argv)
    if args.sentences < 1 or args.batch_size < 1:
        parser.error("--sentences and --batch-size must be at least 1")
    out = args.out if args.out is not None else args.runs[0].resolve().parent.parent / f"search-{args.split}"
    try:
        require_writable_folder(out)
        return compare_runs(args.runs, args.split, args.sentences, out, args.data_root, args.batch_size)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main()
