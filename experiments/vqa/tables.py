"""The VQA task's tables from a results table: the paper's Table 2 and Table 7 layouts, the
uncertainty of every sampling mode, and the noise sweep.

Accuracy is the posterior-mean prediction's; PAvPU is the ``full`` sampling mode's (MC dropout for
soft attention, dropout and attention noise for BAM: the paper's) at p < 0.05, the threshold of the
headline columns (the paper names none; the uncertainty table has all three).
"""

from __future__ import annotations

import pandas as pd

from bam_pyro.metrics import PAVPU_THRESHOLDS
from analysis.tables import format_mean_std, mean_std, paired_difference
from analysis.vqa_figures import sweep_long
from experiments.vqa.easy_vqa import ANSWER_TYPES, type_key
from experiments.vqa.uncertainty import PAVPU_HEADLINE

#: the paper's Table 2 (VQA-v2, MCAN): accuracy original, noisy; PAvPU original, noisy
PAPER_TABLE2 = {
    "soft": (66.95, 61.25, 70.04, 65.34),
    "lf": (66.89, 61.43, 69.92, 65.48),
    "lc": (66.93, 61.58, 70.14, 65.60),
    "wf": (66.93, 61.60, 70.09, 65.62),
    "wc": (67.02, 62.89, 71.21, 66.75),
}
VARIANT_ORDER = ("soft", "lf", "lc", "wf", "wc")
#: Table 2's columns: heading -> results column
TABLE2 = {
    "accuracy, original": "test_acc",
    "accuracy, noisy": "noisy_acc",
    "PAvPU, original": f"clean.full.pavpu@{PAVPU_HEADLINE:g}",
    "PAvPU, noisy": f"noisy.full.pavpu@{PAVPU_HEADLINE:g}",
}
UNCERTAINTY = ("accuracy", "nll", "ece", "brier", "mutual_info", *(f"pavpu@{t:g}" for t in PAVPU_THRESHOLDS))
DIGITS = {"nll": 3, "brier": 3, "mutual_info": 4}


def _paper(values: tuple[float, ...], baseline: tuple[float, ...] | None = None) -> str:
    if baseline is None:
        return " / ".join(f"{v:.2f}" for v in values)
    return " / ".join(f"{v - b:+.2f}" for v, b in zip(values, baseline))


def _mean_std(values: pd.Series, digits: int = 2) -> str:
    """"mean ± std" of the runs that have a value ("" if none has)."""
    values = values.dropna()
    return "" if values.empty else format_mean_std(values.mean(), values.std(ddof=1), digits)


def table2(results: pd.DataFrame) -> pd.DataFrame:
    """Per variant: mean ± std over seeds of accuracy and PAvPU, original and noisy, and the paper's
    four figures (accuracy original / noisy, PAvPU original / noisy)."""
    rows = []
    for variant, runs in results.groupby("variant", sort=False):
        row = {"variant": variant, "seeds": len(runs)}
        row.update({heading: _mean_std(runs[column]) if column in runs else "" for heading, column in TABLE2.items()})
        row["paper (acc orig / noisy, PAvPU orig / noisy)"] = _paper(PAPER_TABLE2[variant]) if variant in PAPER_TABLE2 else ""
        rows.append(row)
    return pd.DataFrame(rows)


def table2_paired(results: pd.DataFrame) -> pd.DataFrame:
    """Per variant: the paired (same seed) difference to soft of each Table 2 figure, mean ± std
    with its 95% interval, beside the paper's differences."""
    differences, pairs = {}, None
    for heading, column in TABLE2.items():
        paired = paired_difference(results, ["dataset"], column) if column in results else pd.DataFrame()
        if not paired.empty:  # empty without soft, or without another variant
            differences[f"{heading} - soft"] = paired.droplevel("dataset")[column]
            pairs = paired.droplevel("dataset")["n"] if pairs is None else pairs
    if pairs is None:
        return pd.DataFrame()
    table = pd.DataFrame(differences)
    table.insert(0, "pairs", pairs)
    table["paper - soft"] = [_paper(PAPER_TABLE2[v], PAPER_TABLE2["soft"]) if v in PAPER_TABLE2 else "" for v in table.index]
    return in_variant_order(table.rename_axis("variant").reset_index()).reset_index(drop=True)


def table7(results: pd.DataFrame) -> pd.DataFrame:
    """Per variant and condition: accuracy and PAvPU (p < 0.05, ``full`` mode) overall and per
    answer type, mean ± std over seeds. The paper's types are VQA-v2's (yes/no, number, other)."""
    rows = []
    for variant, runs in results.groupby("variant", sort=False):
        for condition, accuracy in (("original", "test_acc"), ("noisy", "noisy_acc")):
            prefix = "clean" if condition == "original" else "noisy"
            pavpu = f"{prefix}.full.pavpu@{PAVPU_HEADLINE:g}"
            row = {"variant": variant, "data": condition, "seeds": len(runs)}
            for name, column in (("accuracy", accuracy), ("PAvPU", pavpu)):
                row[f"{name} all"] = _mean_std(runs[column]) if column in runs else ""
                for answer_type in ANSWER_TYPES:
                    key = type_key(answer_type)
                    typed = f"{column}.{key}" if name == "accuracy" else f"{prefix}.full.{key}.pavpu@{PAVPU_HEADLINE:g}"
                    row[f"{name} {answer_type}"] = _mean_std(runs[typed]) if typed in runs else ""
            rows.append(row)
    return pd.DataFrame(rows)


def uncertainty(results: pd.DataFrame) -> pd.DataFrame:
    """Per variant, data and sampling mode: every uncertainty metric, mean ± std over seeds
    (accuracy here is the mean of the draws' probabilities, not the posterior-mean prediction)."""
    rows = []
    for variant, runs in results.groupby("variant", sort=False):
        for condition in ("clean", "noisy"):
            for mode in ("full", "attention"):
                columns = {m: f"{condition}.{mode}.{m}" for m in UNCERTAINTY}
                if columns["accuracy"] not in runs or runs[columns["accuracy"]].isna().all():
                    continue
                row = {"variant": variant, "data": condition, "mode": mode, "seeds": int(runs[columns["accuracy"]].notna().sum())}
                row.update({m: _mean_std(runs[c], DIGITS.get(m, 2)) for m, c in columns.items() if c in runs})
                rows.append(row)
    return pd.DataFrame(rows)


def sweep(results: pd.DataFrame) -> pd.DataFrame:
    """Per variant and noise variance: accuracy and PAvPU at each threshold, mean ± std over seeds."""
    long = sweep_long(results)
    if long.empty:
        return pd.DataFrame()
    table = long.groupby(["variant", "variance", "metric"])["value"].agg(mean_std).unstack("metric")
    table = table.rename_axis(columns=None).reset_index()
    return table.sort_values(["variant", "variance"], key=variant_rank, kind="stable").reset_index(drop=True)


def variant_rank(column: pd.Series) -> pd.Series:
    """Sort key: soft first, then the BAM variants in the paper's order, then any other."""
    if column.name != "variant":
        return column
    return column.map(lambda name: VARIANT_ORDER.index(name) if name in VARIANT_ORDER else len(VARIANT_ORDER))


def in_variant_order(results: pd.DataFrame) -> pd.DataFrame:
    return results.sort_values("variant", key=variant_rank, kind="stable")


def tables(results: pd.DataFrame) -> dict[str, pd.DataFrame]:
    results = in_variant_order(results)
    found = {"table2": table2(results), "table7": table7(results)}
    for name, table in (("table2-paired", table2_paired(results)), ("uncertainty", uncertainty(results)),
                        ("noise-sweep", sweep(results))):
        if not table.empty:
            found[name] = table
    return found
