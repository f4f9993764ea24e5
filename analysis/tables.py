"""Result tables: mean +- std over seeds, ready for CSV and Markdown."""

from __future__ import annotations

import pandas as pd


def summarize(results: pd.DataFrame, by: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per group: ``metric`` as "mean ± std" text, plus the number of runs ``n``."""
    grouped = results.groupby(by, sort=False)
    table = pd.DataFrame(index=grouped.size().index)
    table["n"] = grouped.size()
    for metric in metrics:
        mean, std = grouped[metric].mean(), grouped[metric].std(ddof=1).fillna(0.0)
        table[metric] = [f"{m:.2f} ± {s:.2f}" for m, s in zip(mean, std)]
    return table
