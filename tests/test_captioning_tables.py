"""The captioning tables (experiments.captioning.tables) on run records in the runner's format:
means over seeds, paired differences over shared seeds, METEOR without java, the paper's rows, and
the published Markdown of ``python -m experiments.results captioning``."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from scipy import stats

from experiments import results as published
from experiments.captioning.tables import COLUMNS, NOT_SCORED, PAPER_DATA, tables
from experiments.records import RunFolder, new_record
from experiments.runner import RunSettings, Task

VARIANTS = ("soft", "lc", "wc", "lf", "wf", "hard")
TASK = Task(name="captioning", settings=RunSettings, panel="dataset", panels=("flickr8k", "karpathy"),
            load=lambda settings, data_root: None, train=lambda settings, data, run: {},
            metrics=tuple(COLUMNS.values()), variants=VARIANTS, tables=tables)
#: BLEU-4 of each (variant, seed); the other scores are offsets of it
BLEU4 = {("soft", 0): 10.0, ("soft", 1): 11.0, ("soft", 2): 12.0,
         ("wc", 0): 11.0, ("wc", 1): 13.0, ("wc", 2): 15.0, ("wc", 3): 20.0,  # seed 3 has no soft run
         ("lc", 0): 10.5, ("hard", 0): 7.0}
OFFSETS = {"test_bleu1": 40.0, "test_bleu2": 25.0, "test_bleu3": 10.0, "test_bleu4": 0.0, "test_cider": 20.0,
           "test_rouge_l": 30.0, "test_meteor": 5.0}


def write_runs(folder: Path, meteor: bool = True, **changes) -> Path:
    """A results folder of fake captioning runs as the runner records them (METEOR dropped if not
    ``meteor``; ``changes``: metrics by (variant, seed))."""
    for (variant, seed), bleu4 in BLEU4.items():
        settings = {"variant": variant, "seed": seed, "dataset": "flickr8k", "lr": 5e-4}
        metrics = {name: bleu4 + offset for name, offset in OFFSETS.items() if meteor or name != "test_meteor"}
        metrics.update(changes.get(f"{variant}{seed}", {}))
        RunFolder(folder).save(f"flickr8k-{variant}-seed{seed}", new_record("captioning", settings, metrics, None, 1.0))
    return folder


def load(folder: Path) -> pd.DataFrame:
    return published.load_results(TASK, folder)


def row(table: pd.DataFrame, dataset: str, variant: str) -> pd.Series:
    return table[(table["dataset"] == dataset) & (table["variant"] == variant)].squeeze(axis=0)


def test_table3_has_mean_and_std_over_seeds_in_the_papers_column_order(tmp_path):
    table = tables(load(write_runs(tmp_path)))["table3"]
    assert list(table.columns) == ["dataset", "variant", "seeds", "BLEU-4", "BLEU-3", "BLEU-2", "BLEU-1",
                                   "CIDEr", "ROUGE-L", "METEOR"]
    wc = row(table, "flickr8k", "wc")
    values = pd.Series([11.0, 13.0, 15.0, 20.0])
    assert wc["seeds"] == "4"
    assert wc["BLEU-4"] == f"{values.mean():.2f} ± {values.std(ddof=1):.2f}" == "14.75 ± 3.86"
    assert wc["CIDEr"] == f"{values.mean() + 20:.2f} ± {values.std(ddof=1):.2f}"
    assert row(table, "flickr8k", "lc")["BLEU-1"] == "50.50"  # one seed: no spread


def test_table3_shows_the_papers_ms_coco_rows_as_another_data_set(tmp_path):
    table = tables(load(write_runs(tmp_path)))["table3"]
    paper = table[table["dataset"] == PAPER_DATA]
    assert "MS-COCO" in PAPER_DATA
    assert list(paper["variant"]) == ["soft", "hard", "lc", "wc", "soft (Xu et al.)", "hard (Xu et al.)"]
    assert list(row(table, PAPER_DATA, "soft")[["BLEU-4", "CIDEr", "ROUGE-L", "METEOR"]]) == ["32.2", "104.0", "54.7", "26.1"]
    assert list(row(table, PAPER_DATA, "wc")[["BLEU-4", "BLEU-1", "CIDEr"]]) == ["32.8 ± 0.1", "75.3 ± 0.1", "104.5 ± 0.1"]
    assert row(table, PAPER_DATA, "lc")["CIDEr"] == "105.0"
    assert row(table, PAPER_DATA, "soft (Xu et al.)")["CIDEr"] == ""  # the paper gives none


def test_paired_differences_use_the_seeds_both_variants_ran(tmp_path):
    paired = tables(load(write_runs(tmp_path)))["table3-paired"]
    wc = row(paired, "flickr8k", "wc")
    differences = pd.Series([1.0, 2.0, 3.0])  # seeds 0, 1, 2; seed 3 has no soft run to pair with
    mean, std = differences.mean(), differences.std(ddof=1)
    half = stats.t.ppf(0.975, len(differences) - 1) * std / math.sqrt(len(differences))
    assert wc["pairs"] == "3"
    assert wc["BLEU-4 - soft"] == f"{mean:+.2f} ± {std:.2f}, 95% CI [{mean - half:+.2f}, {mean + half:+.2f}]"
    assert wc["BLEU-4 - soft"] == "+2.00 ± 1.00, 95% CI [-0.48, +4.48]"
    assert wc["CIDEr - soft"] == wc["BLEU-4 - soft"]
    assert row(paired, "flickr8k", "hard")["BLEU-4 - soft"] == "-3.00"
    assert list(paired["variant"]) == ["lc", "wc", "hard"]  # the task's order; soft is the baseline


def test_paired_table_shows_the_papers_differences_of_its_claim(tmp_path):
    paired = tables(load(write_runs(tmp_path)))["table3-paired"]
    claim = ["MS-COCO paper BLEU-4 - soft", "MS-COCO paper CIDEr - soft"]
    assert list(row(paired, "flickr8k", "wc")[claim]) == ["+0.6", "+0.5"]
    assert list(row(paired, "flickr8k", "lc")[claim]) == ["+0.5", "+1.0"]
    assert list(row(paired, "flickr8k", "hard")[claim]) == ["-5.7", "-19.6"]


def test_meteor_without_java_is_marked_not_scored(tmp_path):
    found = tables(load(write_runs(tmp_path, meteor=False)))
    ours = found["table3"][found["table3"]["dataset"] == "flickr8k"]
    assert set(ours["METEOR"]) == {NOT_SCORED["test_meteor"]}
    assert set(found["table3-paired"]["METEOR - soft"]) == {NOT_SCORED["test_meteor"]}
    assert row(found["table3"], PAPER_DATA, "soft")["METEOR"] == "26.1"


def test_meteor_of_only_some_runs_says_how_many(tmp_path):
    folder = write_runs(tmp_path)
    for seed in (0, 1):  # two wc runs scored where java was missing
        path = RunFolder(folder).run_dir(f"flickr8k-wc-seed{seed}") / "record.json"
        path.write_text(path.read_text().replace('"test_meteor"', '"unused"'))
    found = tables(load(folder))
    assert row(found["table3"], "flickr8k", "wc")["METEOR"].endswith("(2 of 4 runs)")
    assert row(found["table3-paired"], "flickr8k", "wc")["METEOR - soft"] == "+3.00 (1 of 3 pairs)"


def test_without_soft_runs_the_paired_table_is_empty(tmp_path):
    results = load(write_runs(tmp_path))
    found = tables(results[results["variant"] != "soft"])
    assert found["table3-paired"].empty
    assert "BLEU-4 - soft" in found["table3-paired"].columns


def test_published_markdown_of_the_results_command(tmp_path, monkeypatch):
    write_runs(tmp_path / "records" / "captioning")
    monkeypatch.setattr(published.catalog, "load_task", lambda name: TASK)
    written = published.build("captioning", tmp_path / "records", tmp_path / "docs")
    assert sorted(p.name for p in written) == ["captioning_paired.md", "captioning_paired.png", "captioning_table3.md"]
    text = (tmp_path / "docs" / "captioning_table3.md").read_text()
    assert text.startswith("<!-- python -m experiments.results captioning: table 'table3' of results/captioning")
    lines = [line for line in text.splitlines() if line.startswith("| ")][1:]
    order = [line.split("|")[1].strip() + " " + line.split("|")[2].strip() for line in lines]
    assert order[:4] == ["flickr8k soft", "flickr8k lc", "flickr8k wc", "flickr8k hard"]
    assert all(entry.startswith(PAPER_DATA) for entry in order[4:]) and len(order) == 10
