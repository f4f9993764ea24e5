"""The captioning task's tables: the paper's Table 3 layout for our runs, and each variant's
paired differences to soft.

``table3``: per data set and variant, mean ± std over seeds of BLEU-4, -3, -2, -1, CIDEr, ROUGE-L
and METEOR of the test captions (the paper's column order), then the paper's Table 3 rows as
printed. Those are MS-COCO's Karpathy test split (5,000 photos, Faster R-CNN box features, 113k
training photos): another data set and scale, shown for orientation, not comparable in level.
METEOR needs ``java``: a run scored without it has no METEOR, and its cell says so.

``table3-paired``: per data set and variant, every score's paired (same seed) difference to soft,
mean ± std with its 95% interval, beside the paper's BLEU-4 and CIDEr differences, the figures of
its claim (BAM-WC and BAM-LC ahead of soft, hard attention behind).
"""

from __future__ import annotations

import pandas as pd

from analysis.tables import mean_std, paired_difference

#: heading -> the results column of that test score, in the paper's Table 3 order
COLUMNS = {"BLEU-4": "test_bleu4", "BLEU-3": "test_bleu3", "BLEU-2": "test_bleu2", "BLEU-1": "test_bleu1",
           "CIDEr": "test_cider", "ROUGE-L": "test_rouge_l", "METEOR": "test_meteor"}
#: the cell of a score no run of a group has
NOT_SCORED = {"test_meteor": "not scored (no java)"}
#: the data-set label of the paper's rows
PAPER_DATA = "MS-COCO, paper's Table 3"
#: the paper's Table 3 as printed, in :data:`COLUMNS` order ("" where it gives none): its Att2in
#: rows under our variant names, then Xu et al.'s (Show, Attend and Tell) as it quotes them
PAPER_TABLE3 = {
    "soft": ("32.2", "43.6", "58.3", "74.9", "104.0", "54.7", "26.1"),
    "hard": ("26.5", "37.2", "51.9", "69.8", "84.4", "50.7", "23.3"),
    "lc": ("32.7", "44.0", "58.7", "75.1", "105.0", "54.8", "26.3"),
    "wc": ("32.8 ± 0.1", "44.1 ± 0.1", "58.8 ± 0.1", "75.3 ± 0.1", "104.5 ± 0.1", "54.9 ± 0.1", "26.2 ± 0.1"),
    "soft (Xu et al.)": ("24.3", "34.4", "49.2", "70.7", "", "", "23.9"),
    "hard (Xu et al.)": ("25.0", "35.7", "50.4", "71.8", "", "", "23.0"),
}
#: the heading of the paper's differences
PAPER_DIFFERENCE = "MS-COCO paper"
#: the scores of the paper's claim, whose differences to soft the paired table shows beside ours
CLAIM = ("BLEU-4", "CIDEr")


def _score_cell(runs: pd.DataFrame, column: str) -> str:
    """"mean ± std" of the runs that have the score; "(k of n runs)" if only some have it."""
    values = runs[column].dropna() if column in runs else pd.Series(dtype=float)
    if values.empty:
        return NOT_SCORED.get(column, "")
    text = mean_std(values)
    return text if len(values) == len(runs) else f"{text} ({len(values)} of {len(runs)} runs)"


def _paper_figure(text: str) -> float:
    """The number of a printed figure ("32.8 ± 0.1" -> 32.8)."""
    return float(text.split("±")[0])


def table3(results: pd.DataFrame) -> pd.DataFrame:
    """Per data set and variant: the number of seeds and each test score's mean ± std; then the
    paper's MS-COCO rows (data set :data:`PAPER_DATA`)."""
    rows = []
    for (dataset, variant), runs in results.groupby(["dataset", "variant"], sort=False):
        rows.append({"dataset": dataset, "variant": variant, "seeds": str(len(runs)),
                     **{heading: _score_cell(runs, column) for heading, column in COLUMNS.items()}})
    for variant, figures in PAPER_TABLE3.items():
        rows.append({"dataset": PAPER_DATA, "variant": variant, "seeds": "", **dict(zip(COLUMNS, figures))})
    return pd.DataFrame(rows, columns=["dataset", "variant", "seeds", *COLUMNS])


def table3_paired(results: pd.DataFrame) -> pd.DataFrame:
    """Per data set and variant but soft: the pairs (seeds both ran), each score's paired
    difference to soft with its 95% interval, and the paper's BLEU-4 and CIDEr differences."""
    columns = ["dataset", "variant", "pairs", *(f"{h} - soft" for h in COLUMNS), *(f"{PAPER_DIFFERENCE} {h} - soft" for h in CLAIM)]
    first = paired_difference(results, ["dataset"], COLUMNS["BLEU-4"])
    if first.empty:  # no soft runs, or no other variant
        return pd.DataFrame(columns=columns)
    table = pd.DataFrame({"pairs": first["n"].astype(str)}, index=first.index)
    for heading, column in COLUMNS.items():
        paired = paired_difference(results, ["dataset"], column) if column in results else pd.DataFrame(columns=["n", column])
        cells, pairs = paired[column].reindex(table.index), paired["n"].reindex(table.index)
        table[f"{heading} - soft"] = [NOT_SCORED.get(column, "") if pd.isna(cell) else cell if n == all_pairs else f"{cell} ({n:.0f} of {all_pairs} pairs)"
                          for cell, n, all_pairs in zip(cells, pairs, first["n"])]
    variants = table.index.get_level_values("variant")
    for heading in CLAIM:
        index = list(COLUMNS).index(heading)
        soft = _paper_figure(PAPER_TABLE3["soft"][index])
        table[f"{PAPER_DIFFERENCE} {heading} - soft"] = [f"{_paper_figure(PAPER_TABLE3[v][index]) - soft:+.1f}" if v in PAPER_TABLE3 else ""
                                            for v in variants]
    order = {variant: i for i, variant in enumerate(results["variant"].unique())}
    return table.reset_index().sort_values("variant", key=lambda v: v.map(order), kind="stable")[columns]


def tables(results: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The task's tables (``Task.tables``): ``table3`` and ``table3-paired``."""
    return {"table3": table3(results), "table3-paired": table3_paired(results)}
