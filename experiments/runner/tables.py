"""Tables: mean ± std per variant, the paired difference to soft and the paper's figures, written
as Markdown and CSV beside the paired-runs picture."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.plots import paired_runs
from analysis.tables import left_out, paired_difference, summarize
from experiments.records import write_atomically
from experiments.runner.task import Task


def paired_table(task: Task, results: pd.DataFrame) -> pd.DataFrame:
    """Per panel and variant (in the task's order of variants): mean ± std over seeds of each metric,
    the runs left out of it (a run that diverged has no value: its record says why), the paired difference to soft of the first metric with its confidence interval, and the paper's
    figures of each metric it gives."""
    rank = {variant: i for i, variant in enumerate(task.variants)}
    tables = []
    for panel, runs in results.groupby(task.panel, sort=False):
        metrics = [m for m in task.metrics_of(panel) if m in runs]
        table = summarize(runs, [task.panel, "variant"], metrics)
        table = table.iloc[sorted(range(len(table)), key=lambda row: rank.get(table.index[row][1], len(rank)))]
        left = left_out(runs, [task.panel, "variant"], metrics)
        if len(left):
            table["left out"] = left.reindex(table.index).fillna("")
        if metrics:
            paired = paired_difference(runs, [task.panel], metrics[0])[metrics[0]]
            table[f"{metrics[0]} - soft (paired)"] = paired.reindex(table.index).fillna("")
        paper = [task.paper.get(p, {}).get(v, {}) for p, v in table.index]
        for metric in [m for m in metrics if any(m in figures for figures in paper)]:
            table[f"paper {metric}"] = [figures.get(metric, "") for figures in paper]
        tables.append(table)
    if not tables:
        return pd.DataFrame()
    table = pd.concat(tables)
    if "left out" in table:
        table["left out"] = table["left out"].fillna("")  # panels that left none out
    paper_columns = [c for c in table if c.startswith("paper ")]
    table[paper_columns] = table[paper_columns].fillna("")  # panels the paper gives no figure for
    return table


def task_tables(task: Task, results: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The task's named tables of ``results`` (its ``tables``, else ``{"results": paired_table}``),
    their index turned into columns, ready for Markdown and CSV."""
    tables = task.tables(results) if task.tables else {"results": paired_table(task, results)}
    return {name: table.reset_index() if any(table.index.names) else table for name, table in tables.items()}


def write_tables(task: Task, results: pd.DataFrame, out: Path) -> dict[str, pd.DataFrame]:
    """``table.md`` (every table), ``table-<name>.csv`` each, and ``paired.png``; printed too."""
    tables = task_tables(task, results)
    text = "\n\n".join(f"### {name}\n\n{table.to_markdown(index=False, disable_numparse=True)}" for name, table in tables.items())
    write_atomically(out / "table.md", lambda partial: partial.write_text(text + "\n"))
    for name, table in tables.items():
        write_atomically(out / f"table-{name}.csv", lambda partial: table.to_csv(partial, index=False))
    drawn = {p: task.metrics_of(p)[0] for p in results[task.panel].unique() if task.metrics_of(p)}
    if drawn and not results.empty:
        write_atomically(out / "paired.png", lambda partial: paired_runs(results, task.panel, drawn, partial))
    if task.after_sweep is not None and not results.empty:
        task.after_sweep(results, out)
    print(text)
    return tables
