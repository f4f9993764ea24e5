"""Result tables: mean +- std over seeds, ready for CSV and Markdown."""

from __future__ import annotations

import math

import pandas as pd
from scipy import stats

#: coverage of the confidence interval printed with a paired difference
CONFIDENCE = 0.95


def format_mean_std(mean: float, std: float, digits: int = 2, sign: str = "") -> str:
    """"mean ± std"; a NaN std (a single run has no spread to show) gives the mean alone."""
    text = f"{mean:{sign}.{digits}f}"
    return text if pd.isna(std) else f"{text} ± {std:.{digits}f}"


def mean_std(values: pd.Series, sign: str = "") -> str:
    """"mean ± std" of a group's runs (see :func:`format_mean_std`); a count that is the same in
    every run (a parameter count) is written whole: 8,911,936."""
    if pd.api.types.is_integer_dtype(values) and values.nunique() == 1:
        return f"{int(values.iloc[0]):{sign},}"
    return format_mean_std(values.mean(), values.std(ddof=1), sign=sign)


def mean_interval(values: pd.Series, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Student-t confidence interval of the mean of ``values`` (NaN bounds for fewer than 2).
    Written from the t quantile: ``stats.t.interval`` returns NaN when every value is the same
    (scale 0), where the interval is the point itself."""
    if len(values) < 2:
        return math.nan, math.nan
    half = stats.t.ppf(0.5 + confidence / 2, len(values) - 1) * stats.sem(values)
    return values.mean() - half, values.mean() + half


def difference_with_interval(values: pd.Series) -> str:
    """"+mean ± std, 95% CI [low, high]" of paired differences: the interval says whether the
    data tell the two apart (it excludes 0) or not. One pair gives the mean alone."""
    text = mean_std(values, sign="+")
    low, high = mean_interval(values)
    if math.isnan(low):
        return text
    return f"{text}, {CONFIDENCE:.0%} CI [{low:+.2f}, {high:+.2f}]"


def summarize(results: pd.DataFrame, by: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per group: ``metric`` as "mean ± std" text, plus ``n``, the number of values of the
    first metric it averages (runs without a value, such as a diverged one, are left out: see
    :func:`left_out`); a metric averaged over another number of runs says so, ``(n = 2)``."""
    grouped = results.groupby(by, sort=False)
    table = pd.DataFrame(index=grouped.size().index)
    table["n"] = grouped[metrics[0]].count() if metrics else grouped.size()
    for metric in metrics:
        counts = grouped[metric].count()
        table[metric] = [cell if count == n else f"{cell} (n = {count})"
                         for cell, count, n in zip(grouped[metric].agg(mean_std), counts, table["n"])]
    return table


def left_out(results: pd.DataFrame, by: list[str], metrics: list[str], reasons: str = "missing") -> pd.Series:
    """Per group of ``by`` that has any: the runs without a value of one of ``metrics``, by seed,
    with the reason their record gives (column ``reasons``): ``seed 1 (score: the run gave nan)``."""
    lacking = results[results[metrics].isna().any(axis=1)] if metrics else results.iloc[:0]
    texts = {}
    for group, runs in lacking.groupby(by, sort=False):
        why = runs[reasons] if reasons in runs else pd.Series("", index=runs.index)
        texts[group] = ", ".join(f"seed {seed} ({reason if isinstance(reason, str) and reason else 'no value'})"
                                 for seed, reason in zip(runs["seed"], why))
    index = pd.MultiIndex.from_tuples(list(texts), names=by) if len(by) > 1 else pd.Index(list(texts), name=by[0])
    return pd.Series(list(texts.values()), index=index, dtype=object)


def paired_difference(
    results: pd.DataFrame, by: list[str], metric: str, baseline: str = "soft", pair_on: str = "seed",
) -> pd.DataFrame:
    """Per group of ``by`` and variant other than ``baseline``: mean ± std over the runs paired on
    ``pair_on`` (same seed) of ``metric(variant) - metric(baseline)`` with the 95% Student-t
    confidence interval of that mean, and the number of pairs ``n``.

    Seeds share data splits, initial weights and batch order, so the paired difference removes that
    common variation: it is the comparison a mean ± std per variant cannot make.
    """
    wide = results.pivot_table(index=[*by, pair_on], columns="variant", values=metric, aggfunc="last")
    rows = {}
    if baseline in wide:
        for variant in (v for v in wide.columns if v != baseline):
            diff = (wide[variant] - wide[baseline]).dropna()
            for group, values in diff.groupby(level=by, sort=False):
                rows[(*(group if isinstance(group, tuple) else (group,)), variant)] = {
                    "n": len(values), metric: difference_with_interval(values)}
    index = pd.MultiIndex.from_tuples(list(rows), names=[*by, "variant"]) if rows else None
    return pd.DataFrame(list(rows.values()), index=index, columns=["n", metric])
