"""Figures of the VQA task: accuracy and PAvPU against feature noise, and the attention picture.

    python -m analysis.vqa_figures runs/vqa        # figures/noise-sweep.png from runs/vqa/results.csv
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from .plots import plt, save_figure

#: ``sweep.<variance>.<metric>``: the variance as ``f"{v:g}"`` writes it, the metric acc or pavpu@<t>
SWEEP_COLUMN = re.compile(r"^sweep\.(?P<variance>.+)\.(?P<metric>acc|pavpu@[\d.]+)$")


def sweep_long(results: pd.DataFrame) -> pd.DataFrame:
    """The ``sweep.<variance>.<metric>`` columns of a results table as rows (variant, seed,
    variance, metric, value); runs without a value are left out."""
    rows = []
    for column in results.columns:
        match = SWEEP_COLUMN.match(column)
        if match:
            part = results[["variant", "seed", column]].dropna().rename(columns={column: "value"})
            rows.append(part.assign(variance=float(match["variance"]), metric=match["metric"]))
    columns = ["variant", "seed", "value", "variance", "metric"]
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=columns)


def noise_sweep_figure(results: pd.DataFrame, path: Path, threshold: float = 0.05) -> Optional[Path]:
    """Accuracy (posterior mean) and PAvPU at p < ``threshold`` against the variance of the feature
    noise, one line per variant (mean over seeds, band: ± std). None when no run has a sweep."""
    long = sweep_long(results)
    panels = [("acc", "accuracy (%)"), (f"pavpu@{threshold:g}", f"PAvPU, p < {threshold:g} (%)")]
    panels = [(metric, label) for metric, label in panels if (long["metric"] == metric).any()]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, (metric, label) in zip(axes[0], panels):
        rows = long[long["metric"] == metric]
        variants = sorted(dict.fromkeys(rows["variant"]), key=lambda v: v != "soft")  # soft first, then as found
        for variant in variants:
            group = rows[rows["variant"] == variant]
            stats = group.groupby("variance")["value"].agg(["mean", "std", "count"])
            seeds = stats["count"].max()
            line, = ax.plot(stats.index, stats["mean"], marker="o", ms=4, label=f"{variant} ({seeds} seed{'s' if seeds > 1 else ''})")
            ax.fill_between(stats.index, stats["mean"] - stats["std"].fillna(0), stats["mean"] + stats["std"].fillna(0),
                            color=line.get_color(), alpha=0.15, lw=0)
        ax.set(xlabel="variance of the feature noise", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("easy-VQA test set: Gaussian noise on the image grid features", fontsize=10)
    return save_figure(fig, path)


@dataclass
class QuestionView:
    """What the attention picture shows of one test question.

    ``attention_draws`` ``[draws, words]``: guided attention each word gets from the grid (averaged
    over grid cells and heads), one row per posterior draw; ``prior`` ``[words]``: the prior's
    attention; ``answer_draws`` ``[draws, answers]``: answer probabilities of the posterior draws;
    ``image_weights`` ``[grid, grid]``: the image reduction's weights (posterior mean);
    ``pvalue``: the top-two t-test of PAvPU.
    """

    image: np.ndarray
    question: str
    words: Sequence[str]
    attention_draws: np.ndarray
    prior: np.ndarray
    answer_draws: np.ndarray
    answers: Sequence[str]
    truth: int
    pvalue: float
    image_weights: np.ndarray


def spotlight(image: np.ndarray, weights: np.ndarray, floor: float = 0.25) -> np.ndarray:
    """``image`` ``[H, W, 3]`` uint8 with each cell of a ``weights`` grid dimmed in proportion to its
    weight (the largest keeps full brightness, a zero weight keeps ``floor`` of it)."""
    size = image.shape[0]
    if size % weights.shape[0]:
        raise ValueError(f"a {weights.shape[0]}x{weights.shape[1]} grid does not tile a {size}-pixel image")
    cell = size // weights.shape[0]
    scale = floor + (1 - floor) * weights / max(float(weights.max()), 1e-12)
    return (image * np.kron(scale, np.ones((cell, cell)))[..., None]).astype(np.uint8)


def attention_picture(views: Sequence[QuestionView], path: Path, title: str = "", top: int = 4, threshold: float = 0.05) -> Path:
    """One row per question: the image with the weights the answer reads each grid cell with; the
    attention the grid pays to each question word, posterior mean with a 94% interval of the draws
    beside the prior's; the ``top`` answers' probabilities over the draws, the true one marked,
    and the verdict of the t-test (certain at p < ``threshold``)."""
    fig, axes = plt.subplots(len(views), 3, figsize=(13, 2.9 * len(views)), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 2.2, 1.4]})
    for (image_ax, word_ax, answer_ax), view in zip(axes, views):
        image_ax.imshow(spotlight(view.image, view.image_weights))
        image_ax.set(xticks=[], yticks=[])
        image_ax.set_title(f"grid cells lit by the image reduction's weight\n(largest {view.image_weights.max():.2f})", fontsize=8)

        x = np.arange(len(view.words))
        mean = view.attention_draws.mean(0)
        low, high = np.quantile(view.attention_draws, [0.03, 0.97], axis=0)
        word_ax.bar(x - 0.2, view.prior, 0.4, color="tab:grey", alpha=0.6, label="prior")
        word_ax.bar(x + 0.2, mean, 0.4, color="tab:blue", label="posterior mean")
        word_ax.errorbar(x + 0.2, mean, yerr=[mean - low, high - mean], fmt="none", color="black", capsize=3, lw=1,
                         label="94% of the draws")
        word_ax.set_xticks(x, view.words, fontsize=8)
        word_ax.set_ylabel("attention from the grid")
        word_ax.set_title(view.question, fontsize=9)
        word_ax.set_ylim(0, 1.4 * max(float(high.max()), float(view.prior.max())))
        word_ax.legend(fontsize=7, loc="upper right", ncol=3)

        mean_probs = view.answer_draws.mean(0)
        order = np.argsort(-mean_probs)[:top]
        positions = np.arange(len(order))
        answer_ax.boxplot([view.answer_draws[:, a] for a in order], positions=positions, widths=0.5, showfliers=False)
        answer_ax.scatter(positions, mean_probs[order], color="tab:red", zorder=3, s=12, label="mean")
        labels = [f"{view.answers[a]}{' (true)' if a == view.truth else ''}" for a in order]
        answer_ax.set_xticks(positions, labels, fontsize=8, rotation=20)
        verdict = "certain" if view.pvalue < threshold else "uncertain"
        answer_ax.set(ylim=(-0.02, 1.02), ylabel="probability")
        answer_ax.set_title(f"answer: {view.answers[order[0]]} (p = {view.pvalue:.2g}, {verdict})", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> Optional[Path]:
    parser = argparse.ArgumentParser(prog="python -m analysis.vqa_figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="output folder of a VQA sweep (holds results.csv)")
    parser.add_argument("--threshold", type=float, default=0.05, help="PAvPU's p-value threshold drawn")
    args = parser.parse_args(argv)
    results = args.folder / "results.csv"
    if not results.is_file():
        parser.exit(2, f"{parser.prog}: error: no results.csv in {args.folder}\n")
    path = noise_sweep_figure(pd.read_csv(results), args.folder / "figures" / "noise-sweep.png", args.threshold)
    if path is None:
        parser.exit(2, f"{parser.prog}: error: no run in {results} has noise-sweep columns\n")
    print(path)
    return path


if __name__ == "__main__":
    main()
