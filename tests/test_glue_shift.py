"""The text shift (SST-2 against other corpora): the sets, the draws saved for them by
``python -m experiments.glue.ood``, and the uncertainty-under-shift tables of the shared code."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.special import softmax

import experiments.results
from experiments.glue import ood
from experiments.glue.published import SHIFT
from experiments.glue.data import beyond_subset, read_split, subset
from experiments.glue.shift import MULTI30K_FILE, OOD_SETS, TEMPERATURE_EXAMPLES, capped, ood_sentences, temperature_examples
from experiments.glue.shift_tables import SETS, reliability_figures, risk_coverage_figures, shift_tables
from experiments.glue.task import TASK
from experiments.records import RunFolder, new_record
from experiments.results import load_results
from experiments.runner.shift_draws import SHIFT_FILE
from experiments.runner.shift_tables import ENSEMBLE

WORDS = "a the good bad movie film great awful story actor plot fun dull long short boring lovely".split()
TRAIN, DEV, OOD_LINES, MAX_TRAIN, MAX_OOD = TEMPERATURE_EXAMPLES + 40, 24, 30, 16, 12


def sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 12))) + f" {i}" for i in range(n)]


def write_tsv(path: Path, rows: list[list], header: list[str] | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n")
        writer.writerows(([header] if header else []) + rows)


@pytest.fixture(scope="module")
def text_root(tmp_path_factory) -> Path:
    """A data root of tiny SST-2 train and dev sets, and the three out-of-distribution corpora."""
    root, rng = tmp_path_factory.mktemp("text-root"), np.random.default_rng(0)
    for split, n in (("train", TRAIN), ("dev", DEV)):
        write_tsv(root / "glue" / "SST-2" / f"{split}.tsv",
                  [[s, int(rng.integers(0, 2))] for s in sentences(n, len(split))], ["sentence", "label"])
    write_tsv(root / "glue" / "RTE" / "dev.tsv", [[i, "A long premise.", s, "entailment"] for i, s in enumerate(sentences(OOD_LINES, 7))],
              ["index", "sentence1", "sentence2", "label"])
    write_tsv(root / "glue" / "CoLA" / "dev.tsv", [["src", 1, "", s] for s in sentences(OOD_LINES, 8)], None)
    (root / "multi30k").mkdir()
    with gzip.open(root / "multi30k" / MULTI30K_FILE, "wt") as handle:
        handle.writelines(f"A dog runs on the grass {i}.\n" for i in range(OOD_LINES))
    return root


@pytest.fixture(scope="module")
def trained(text_root, tiny_bert_folder, tmp_path_factory) -> Path:
    """A soft and a BAM-WC run of the tiny random BERT, one epoch on 16 sentences: their output folder."""
    from experiments.glue.task import main as glue

    out = tmp_path_factory.mktemp("glue-sst2")
    glue(["--task", "sst2", "--variant", "soft", "wc", "--seeds", "0", "--model", str(tiny_bert_folder), "--data-root", str(text_root),
          "--out", str(out), "--max-train", str(MAX_TRAIN), "--epochs", "1", "--max-length", "32", "--draws", "2",
          "--threads", "1", "--no-progress"])
    return out


@pytest.fixture(scope="module")
def drawn(trained, text_root) -> dict[str, Path]:
    """The runs' shift.npz, by variant, written by the script."""
    runs = [RunFolder(trained).run_dir(f"sst2-{variant}-seed0") for variant in ("soft", "wc")]
    written = ood.main([*map(str, runs), "--data-root", str(text_root), "--draws", "3", "--max-ood", str(MAX_OOD)])
    assert written == [run / SHIFT_FILE for run in runs]
    return dict(zip(("soft", "wc"), written))


def test_the_script_saves_every_set_and_mode_normalized_in_file_order(drawn, text_root):
    sizes = {"id": DEV, **dict.fromkeys(OOD_SETS, MAX_OOD)}
    for variant, path in drawn.items():
        arrays = np.load(path)
        modes = ["mc_dropout"] if variant == "soft" else ["attention", "attention_dropout"]
        expected = {"id.labels"} | {f"{s}.{m}.{part}" for s in sizes for m in modes for part in ("probs", "mutual_info")}
        if variant == "soft":
            expected |= {"val.logits", "val.labels", *(f"{s}.logits" for s in sizes)}
        assert set(arrays.files) == expected
        for s, n in sizes.items():
            for mode in modes:
                probs = arrays[f"{s}.{mode}.probs"]
                assert probs.shape == (n, 2) and probs.dtype == np.float16
                assert np.allclose(probs.astype(np.float64).sum(-1), 1, atol=1e-2)
                assert arrays[f"{s}.{mode}.mutual_info"].dtype == np.float32 and (arrays[f"{s}.{mode}.mutual_info"] >= 0).all()
        assert arrays["id.labels"].tolist() == read_split("sst2", "dev", text_root)["label"].tolist()  # the dev set's order
    soft = np.load(drawn["soft"])
    assert soft["val.logits"].shape == (TEMPERATURE_EXAMPLES, 2)
    held_out = temperature_examples("sst2", MAX_TRAIN, text_root)
    assert soft["val.labels"].tolist() == held_out["label"].tolist()
    assert not list(drawn["soft"].parent.glob(".shift-*"))  # staged write: no partial file left


def test_saved_logits_are_each_sentence_alone_in_file_order(drawn, trained, text_root):
    """The logits gathered by length-sorted batches are put back in the sentences' order: each row
    is what the network gives that sentence in a batch of its own (no padding)."""
    from experiments.runner import load_trained

    _, data, model = load_trained(TASK, RunFolder(trained).run_dir("sst2-soft-seed0"), str(text_root))
    logits = np.load(drawn["soft"])["id.logits"].astype(np.float64)
    with torch.no_grad():
        for i in (0, 5, DEV - 1):
            ids = torch.tensor([data.scored.input_ids[i]])
            alone = model.network(ids, torch.ones_like(ids), torch.zeros_like(ids))[0].numpy()
            np.testing.assert_allclose(logits[i], alone, atol=2e-2)


def test_mc_dropout_draws_differ_and_soft_deterministic_ones_do_not(trained, text_root, drawn):
    from experiments.glue.task import posterior_probs
    from experiments.runner import load_trained

    _, data, model = load_trained(TASK, RunFolder(trained).run_dir("sst2-soft-seed0"), str(text_root))
    dropped, _ = posterior_probs(model, data.scored, 8, data.collator, draws=4, seed=0, dropout=True)
    still, _ = posterior_probs(model, data.scored, 8, data.collator, draws=4, seed=0)
    assert dropped.shape == (4, DEV, 2) and dropped.std(0).max() > 1e-4
    assert still.shape == (2, DEV, 2) and np.array_equal(still[0], still[1])  # soft attention is a point mass
    assert not model.network.training  # the draws leave the model in eval mode
    assert np.load(drawn["soft"])["id.mc_dropout.mutual_info"].max() > 0


def test_a_damaged_ood_file_is_one_line_naming_it(trained, text_root, tmp_path, capsys):
    broken = tmp_path / "root"
    (broken / "multi30k").mkdir(parents=True)
    (broken / "glue").symlink_to(text_root / "glue")
    (broken / "multi30k" / MULTI30K_FILE).write_bytes(b"\x1f\x8b not really gzip")
    run = RunFolder(trained).run_dir("sst2-wc-seed0")
    with pytest.raises(SystemExit) as ended:
        ood.main([str(run), "--data-root", str(broken), "--redo"])
    message = capsys.readouterr().err
    assert ended.value.code == 2 and message.count("\n") == 1
    assert f"{broken / 'multi30k' / MULTI30K_FILE}, line 1: not a whole gzip file" in message
    (broken / "multi30k" / MULTI30K_FILE).unlink()
    with pytest.raises(SystemExit):
        ood.main([str(run), "--data-root", str(broken), "--redo"])
    assert f"missing {MULTI30K_FILE} in {broken / 'multi30k'}" in capsys.readouterr().err


def test_the_temperature_examples_are_beyond_the_training_subset(data_root):
    frame = pd.DataFrame({"text_a": [f"s{i}" for i in range(50)], "label": np.arange(50) % 2})
    trained, held = subset(frame, 20), beyond_subset(frame, 20, 30)
    assert len(held) == 30 and not set(trained["text_a"]) & set(held["text_a"])
    assert set(trained["text_a"]) | set(held["text_a"]) == set(frame["text_a"])
    with pytest.raises(ValueError, match="at most 30 are left"):
        beyond_subset(frame, 20, 31)
    with pytest.raises(ValueError, match="whole sst2 training set"):
        temperature_examples("sst2", None, data_root)
    sst2 = read_split("sst2", "train", data_root).reset_index()  # the real runs': 2,000 trained, 1,000 held out
    trained, held = subset(sst2, 2000), beyond_subset(sst2, 2000, TEMPERATURE_EXAMPLES)
    assert len(held) == TEMPERATURE_EXAMPLES and not set(trained["index"]) & set(held["index"])


def test_ood_sets_read_one_sentence_per_input(text_root):
    assert ood_sentences("rte", text_root) == sentences(OOD_LINES, 7)  # the hypotheses, not the premises
    assert ood_sentences("cola", text_root) == sentences(OOD_LINES, 8)
    assert ood_sentences("multi30k", text_root)[:2] == ["A dog runs on the grass 0.", "A dog runs on the grass 1."]


def test_ood_sets_are_capped_to_a_fixed_subset_in_file_order():
    lines = [f"line {i}" for i in range(40)]
    kept = capped(lines, 10)
    assert len(kept) == 10 and kept == sorted(kept, key=lines.index) and kept == capped(lines, 10)
    assert capped(lines, 100) == lines


def fake_folder(tmp_path: Path, soft_seeds: int = ENSEMBLE + 1, bam_seeds: int = 2) -> tuple:
    """Records and shift.npz of SST-2 runs whose every method predicts, on 4 dev sentences and on
    2 sentences of each other corpus, the probabilities of class 0 below: the uncertainty ranks
    in < in < out < in < in < out, for every score but the mutual information."""
    folder = RunFolder(tmp_path / "glue-sst2-shift")
    id_probs = softmax(np.log([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.55, 0.45]]), -1)
    ood_probs = np.array([[0.7, 0.3], [0.5, 0.5]])
    labels = np.array([0, 0, 1, 0], np.int8)  # the third dev sentence predicted wrong
    for variant, seeds in (("soft", soft_seeds), ("wc", bam_seeds)):
        for seed in range(seeds):
            settings = TASK.settings_for("sst2", variant, seed, {"max_train": 2000})
            folder.save(TASK.run_name(settings), new_record("glue", settings.row(), {"accuracy": 75.0, "train_loss": 0.5}, None, 1.0))
            arrays = {"id.labels": labels, "val.logits": np.log(id_probs).astype(np.float16), "val.labels": labels}
            for s in SETS:
                probs = id_probs if s.name == "id" else ood_probs
                arrays[f"{s.name}.logits"] = np.log(probs).astype(np.float16)
                for mode in (["mc_dropout"] if variant == "soft" else ["attention", "attention_dropout"]):
                    arrays[f"{s.name}.{mode}.probs"] = probs.astype(np.float16)
                    arrays[f"{s.name}.{mode}.mutual_info"] = np.zeros(len(probs), np.float32)
            np.savez(folder.run_dir(TASK.run_name(settings)) / SHIFT_FILE, **arrays)
    return load_results(TASK, folder.out), folder


def test_the_shared_tables_give_the_hand_computed_detection(tmp_path):
    """AUROC: of the 2 x 4 (out, in) pairs, the out item is the less certain in 2 + 4: 75%.
    FPR95: flagging both out items flags the 2 in items above the first: 50%. AUPR-out: the out
    items come 1st and 4th, precision 1 and 1/2: 75%."""
    results, folder = fake_folder(tmp_path)
    tables = shift_tables(results, folder)
    detection = tables["detection"]
    assert list(detection.columns[:4]) == ["task", "method", "score", "n"]
    assert [c for c in detection.columns if "AURC" in c] == ["AURC ID"]  # selective prediction on SST-2 dev only
    assert set(detection["method"]) == {"soft", "temperature", "MC dropout", "ensemble", "BAM-WC", "BAM-WC + dropout"}
    assert set(detection["n"]) == {2}  # seeds 0 and 1: the seeds with an ensemble of 5 soft runs
    certain = detection[detection["score"] != "MI"]
    for name in OOD_SETS:
        assert (certain[f"AUROC {name}"] == "75.00 ± 0.00").all()
        assert (certain[f"FPR95 {name}"] == "50.00 ± 0.00").all()
        assert (certain[f"AUPR-out {name}"] == "75.00 ± 0.00").all()
    drawn_mi = detection[(detection["score"] == "MI") & detection["method"].str.startswith(("MC", "BAM"))]
    assert len(drawn_mi) == 3 and (drawn_mi["AUROC rte"] == "50.00 ± 0.00").all()  # MI 0 everywhere: all tied
    calibration = tables["calibration"]
    assert [c for c in calibration.columns if c.startswith(("acc", "ECE"))] == ["acc ID", "ECE ID"]
    assert (calibration["acc ID"] == "75.00 ± 0.00").all()
    paired = tables["paired"]
    assert len(paired) == 2 * 3 and list(paired.columns[4:]) == [*(f"AUROC {n}" for n in OOD_SETS), "AURC ID"]
    assert paired["AUROC multi30k"].str.startswith("+0.00 ± 0.00").all()
    assert [p.name for p in risk_coverage_figures(TASK, results, folder, tmp_path / "rc.png")] == ["rc_sst2.png"]
    assert reliability_figures(TASK, results, folder, tmp_path / "rel.png")[0].stat().st_size > 0


def test_results_publish_the_same_bytes_from_the_same_records(tmp_path, monkeypatch):
    """``python -m experiments.results glue --add glue-sst2-shift=FOLDER`` with the shift tables
    published: the records and shift.npz copied, three tables and two figures drawn; drawn again
    from the copied records, every file is byte for byte the same."""
    _, folder = fake_folder(tmp_path / "runs")
    monkeypatch.setitem(experiments.results.PUBLISHED, "glue", SHIFT)
    records, first, second = tmp_path / "results", tmp_path / "first", tmp_path / "second"
    written = experiments.results.main(["glue", "--records", str(records), "--out", str(first),
                                        "--add", f"glue-sst2-shift={folder.out}"])
    tables = [f"glue_sst2_shift_{name}.md" for name in ("calibration", "detection", "paired")]
    figures = ["glue_sst2_shift_reliability_sst2.png", "glue_sst2_shift_risk_coverage_sst2.png"]
    assert sorted(p.name for p in written) == sorted([*tables, *figures])
    run = sorted((records / "glue-sst2-shift" / "runs").iterdir())[0]
    assert sorted(p.name for p in run.iterdir()) == ["record.json", SHIFT_FILE]
    again = experiments.results.build("glue", records, second)
    assert [p.name for p in again] == [p.name for p in written]
    for path in written:
        assert (second / path.name).read_bytes() == path.read_bytes(), path.name
