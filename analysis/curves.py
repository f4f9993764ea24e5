"""Training curves from run records: which epoch early stopping kept, and what the run reached.

:func:`curves_report` takes run records (the per-epoch history and the early-stopping record of
each) and writes ``curves.csv``, one row per run with the kept epoch's validation metrics next to
the best each metric reached in the run, ``summary.md`` with their medians per run group (the runs
of one panel and variant), and ``curves.png``, the validation curves with the kept epochs marked
(a panel per run group, or with ``overlay`` all groups on one axis). ``python -m
experiments.curves`` reads the records of output folders and calls it.

GAT's rule keeps the last epoch that improves validation loss and accuracy together; an accuracy
peak early in training, while the loss is still falling, can be that epoch. This shows how far
the kept model's loss (its confidence) is from the run's best.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
import pandas as pd  # noqa: E402

from .plots import save_figure  # noqa: E402


#: metrics where lower is better, for runs without early stopping (or whose checkpoints predate
#: the saved monitors); every other metric is taken as higher-is-better
LOWER_IS_BETTER = ("loss", "nll", "ece", "brier")


def _direction(metric: str, monitors: Optional[dict[str, str]]) -> str:
    """'min' or 'max': the run's early-stopping monitor when it has one, else by the metric's name."""
    if monitors and metric in monitors:
        return monitors[metric]
    return "min" if metric.endswith(LOWER_IS_BETTER) else "max"


def run_curve(record: dict) -> tuple[pd.DataFrame, dict]:
    """A record's history (one row per epoch) and what :func:`training_curves` needs of the run:
    ``run``, ``group`` (the run without its seed), ``epochs``, ``kept_epoch`` and ``monitors``."""
    training = record.get("training")
    if not training or not training.get("history"):
        raise ValueError(f"the run {record.get('run')} has no training history")
    run = record["run"]
    return pd.DataFrame(training["history"]), {
        "run": run, "group": run.rsplit("-seed", 1)[0], "epochs": training["epochs"],
        "kept_epoch": training["best_epoch"], "monitors": training.get("monitors")}


def validation_metrics(history: pd.DataFrame) -> list[str]:
    """The metrics a run's history holds per epoch, besides the training loss and timings
    (``*seconds``, e.g. translation's ``eval_seconds``: how long, not how well)."""
    return [c for c in history.columns if c not in ("epoch", "loss") and not c.endswith("seconds")]


def kept_versus_best(history: pd.DataFrame, record: dict) -> dict:
    """For every validation metric: its value at the kept epoch and the best the run reached."""
    row = {k: record[k] for k in ("run", "group", "epochs", "kept_epoch")}
    at_kept = history.set_index("epoch").loc[record["kept_epoch"]]
    for metric in validation_metrics(history):
        best = history[metric].min() if _direction(metric, record["monitors"]) == "min" else history[metric].max()
        row[f"kept_{metric}"] = at_kept[metric]
        row[f"best_{metric}"] = best
        row[f"best_{metric}_epoch"] = int(history.loc[history[metric] == best, "epoch"].iloc[0])
    return row


def training_curves(run_records: Sequence[dict], path: Path, overlay: bool = False) -> Path:
    """:func:`curves_figure` written to ``path`` (PNG)."""
    return save_figure(curves_figure(run_records, overlay), path)


def curves_figure(run_records: Sequence[dict], overlay: bool = False) -> Figure:
    """The validation curves of runs (their records): one row per validation metric of any group
    (tasks have their own metrics; a cell whose runs lack the metric is left out), a line per run, a
    dot at the kept epoch. One column per run group, or with ``overlay`` one column for all, a
    colour per group: the comparison of variants at a glance. The axis leaves out the worst 5% of
    values (the first epochs), where they would squeeze the rest into a band, and is logarithmic
    where the values shown span more than a factor of 3."""
    curves = [run_curve(r) for r in run_records]
    histories = {info["run"]: history for history, info in curves}
    records = [info for _, info in curves]
    groups = list(dict.fromkeys(r["group"] for r in records))
    colours = {group: f"C{i % 10}" for i, group in enumerate(groups)}
    columns = [groups] if overlay else [[group] for group in groups]
    metrics = list(dict.fromkeys(m for r in records for m in validation_metrics(histories[r["run"]])))
    width = 4.5 if overlay else 3.2
    fig, axes = plt.subplots(
        len(metrics), len(columns), figsize=(width * len(columns), 2.8 * len(metrics)), squeeze=False, sharex="col"
    )
    for column, shown_groups in enumerate(columns):
        for row, metric in enumerate(metrics):
            ax = axes[row][column]
            runs = [r for r in records if r["group"] in shown_groups and metric in histories[r["run"]]]
            if not runs:
                ax.set_visible(False)
                continue
            labelled = set()
            for record in runs:
                history = histories[record["run"]].set_index("epoch")[metric]
                colour = colours[record["group"]] if overlay else None
                label = record["group"] if overlay and record["group"] not in labelled else None
                labelled.add(record["group"])
                line, = ax.plot(history.index, history, lw=0.8, alpha=0.7, color=colour, label=label)
                ax.plot(record["kept_epoch"], history.loc[record["kept_epoch"]], "o", ms=4, color=line.get_color())
            values = pd.concat([histories[r["run"]][metric] for r in runs])
            low, high = values.min(), values.max()
            if _direction(metric, runs[0]["monitors"]) == "min":
                high = values.quantile(0.95)
            else:
                low = values.quantile(0.05)
            if low > 0 and high > 3 * low:  # a perplexity falling from 30 to 6: the last epochs stay apart
                ax.set_yscale("log")
                ax.set_ylim(low / 1.05, high * 1.05)
                for axis_ticks in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                    axis_ticks(FuncFormatter(lambda value, _: f"{value:g}"))  # 6, 7, 10, 20: not 6 x 10^0
            else:
                margin = 0.05 * (high - low) or 0.01
                ax.set_ylim(low - margin, high + margin)
            if overlay:
                ax.legend(fontsize=7, frameon=False)
        shown = [ax for ax in axes[:, column] if ax.get_visible()]
        if not overlay:
            shown[0].set_title(shown_groups[0], fontsize=10)
        shown[-1].set_xlabel("epoch")
        shown[-1].xaxis.set_tick_params(labelbottom=True)  # sharex labels only the bottom row, which may be left out
    for row, metric in enumerate(metrics):
        next(ax for ax in axes[row] if ax.get_visible()).set_ylabel(metric)
    fig.suptitle("validation curves, one line per run; dots: the epochs early stopping kept", fontsize=10)
    fig.tight_layout()
    return fig


def curves_report(run_records: Sequence[dict], out: Path, overlay: bool = False) -> pd.DataFrame:
    """Write ``curves.csv``, ``summary.md`` and ``curves.png`` of the runs (their records, each
    with a training history) into ``out`` (see module doc); returns the per-run table."""
    table = pd.DataFrame([kept_versus_best(*run_curve(r)) for r in run_records])
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "curves.csv", index=False)
    summary = table.drop(columns="run").groupby("group", sort=False).median().round(3).add_prefix("median ")
    summary.insert(0, "runs", table.groupby("group", sort=False).size())
    (out / "summary.md").write_text(summary.to_markdown() + "\n")
    training_curves(run_records, out / "curves.png", overlay=overlay)
    print(summary.to_markdown())
    return table
