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


def paired_difference(
    results: pd.DataFrame, by: list[str], metric: str, baseline: str = "soft", pair_on: str = "seed",
) -> pd.DataFrame:
    """Per group of ``by`` and variant other than ``baseline``: mean ± std over the runs paired on
    ``pair_on`` (same seed) of ``metric(variant) - metric(baseline)``, and the number of pairs ``n``.

    Seeds share data splits, initial weights and batch order, so the paired difference removes that
    common variation: it is the comparison a mean ± std per variant cannot make.
    """
    wide = results.pivot_table(index=[*by, pair_on], columns="variant", values=metric, aggfunc="last")
    rows = {}
    if baseline in wide:
        for variant in (v for v in wide.columns if v != baseline):
            diff = (wide[variant] - wide[baseline]).dropna()
            for group, values in diff.groupby(level=by, sort=False):
                std = values.std(ddof=1) if len(values) > 1 else 0.0
                rows[(*(group if isinstance(group, tuple) else (group,)), variant)] = {
                    "n": len(values), metric: f"{values.mean():+.2f} ± {std:.2f}"}
    index = pd.MultiIndex.from_tuples(list(rows), names=[*by, "variant"]) if rows else None
    return pd.DataFrame(list(rows.values()), index=index, columns=["n", metric])
