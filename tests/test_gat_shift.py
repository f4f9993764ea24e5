"""The graph shifts (left-out classes, flipped words), the draws saved for them, the ensemble and
the uncertainty-under-shift tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import softmax

from bam_pyro.metrics import entropy
from experiments.catalog import load_task
from experiments.gat import ood
from experiments.gat.shift import flip_features, leave_out_classes
from experiments.gat.shift_tables import predictions, reliability_figures, risk_coverage_figures, shift_tables
from experiments.gat.task import main as gat_main
from experiments.records import RunFolder, new_record
from experiments.results import load_results
from experiments.runner.shift_draws import SHIFT_FILE
from experiments.runner.shift_tables import ENSEMBLE, METHODS, SAMPLED, Prediction, pooled


def test_left_out_masks_by_enumeration(cora):
    data, features, kept = leave_out_classes(*cora, left_out=3)
    assert (features, kept) == (cora[1], 4)
    original = cora[0]
    for node in range(original.num_nodes):
        label = int(original.y[node])
        for name in ("train_mask", "val_mask", "test_mask"):
            assert bool(data[name][node]) == (bool(original[name][node]) and label < 4), (name, node)
        assert bool(data.ood_mask[node]) == (bool(original.test_mask[node]) and label >= 4)
    assert int(data.ood_mask.sum()) == sum(int((original.y[original.test_mask] == c).sum()) for c in (4, 5, 6))
    with pytest.raises(ValueError, match="left_out must lie in 1..5"):
        leave_out_classes(*cora, left_out=6)


@pytest.mark.parametrize("p", [0.01, 0.05, 0.3])
def test_flips_at_rate_p_on_the_chosen_nodes_only(cora, p):
    x = cora[0].x
    nodes = torch.arange(0, 2000, 2)
    shifted = flip_features(x, nodes, p, seed=3)
    flipped = ((shifted[nodes] > 0) != (x[nodes] > 0)).float().mean().item()
    n = nodes.numel() * x.shape[1]
    assert abs(flipped - p) < 4 * (p * (1 - p) / n) ** 0.5
    others = torch.ones(x.shape[0], dtype=torch.bool)
    others[nodes] = False
    assert torch.equal(shifted[others], x[others])
    rows = shifted[nodes].sum(-1)
    assert torch.allclose(rows[rows > 0], torch.ones_like(rows[rows > 0]))
    assert torch.equal(flip_features(x, nodes, p, seed=3), shifted)  # a fixed seed, the same flips
    assert torch.equal(flip_features(x, nodes, 0.0), x)


def test_ensemble_pools_by_hand():
    rng = np.random.default_rng(0)
    members = [Prediction(softmax(rng.normal(size=(4, 3)), -1), np.zeros(4, int)) for _ in range(ENSEMBLE)]
    ensemble = pooled(members)
    mean = sum(m.probs for m in members) / ENSEMBLE
    assert np.allclose(ensemble.probs, mean)
    assert np.allclose(ensemble.mutual_info, entropy(mean) - sum(entropy(m.probs) for m in members) / ENSEMBLE)
    assert set(ensemble.scores()) == {"1 - max p", "entropy", "MI"} and set(members[0].scores()) == {"1 - max p", "entropy"}


def fake_folder(tmp_path, left_out: int, soft_seeds: int = ENSEMBLE + 1, bam_seeds: int = 2):
    """Records and shift.npz of Cora runs: clean nodes predicted right and confidently by every
    run, shifted (or left-out) nodes nearly uniformly and differently by each: every score tells
    them apart perfectly."""
    task, folder = load_task("gat"), RunFolder(tmp_path / f"runs-{left_out}")
    classes, rng = 7 - left_out, np.random.default_rng(1)
    sets = ood.evaluation_set_names(left_out)
    for variant, seeds in (("soft", soft_seeds), ("wc", bam_seeds), ("lc", bam_seeds)):
        for seed in range(seeds):
            settings = task.settings_for("cora", variant, seed, {"left_out": left_out})
            name = task.run_name(settings)
            folder.save(name, new_record("gat", settings.row(), {"test_acc": 80.0, "val_acc": 80.0}, None, 1.0))
            arrays = {"val.logits": rng.normal(size=(20, classes)).astype(np.float16), "val.labels": rng.integers(0, classes, 20).astype(np.int8)}
            for i, s in enumerate(sets):
                labels = np.random.default_rng(i).integers(0, classes, 30)  # the same nodes in every run
                logits = 5 * np.eye(classes)[labels] if s == "id" else 0.3 * rng.normal(size=(30, classes))
                arrays[f"{s}.labels"], arrays[f"{s}.logits"] = labels.astype(np.int8), logits.astype(np.float16)
                for mode in [m for v, m in SAMPLED.values() if v == variant]:
                    arrays[f"{s}.{mode}.probs"] = softmax(logits + seed * 0.01, -1).astype(np.float16)
                    arrays[f"{s}.{mode}.mutual_info"] = np.full(30, 0.0 if s == "id" else 0.5, np.float32)
            np.savez(folder.run_dir(name) / SHIFT_FILE, **arrays)
    return task, folder


@pytest.mark.parametrize("left_out", [0, 3])
def test_tables_of_tiny_fake_records(tmp_path, left_out):
    task, folder = fake_folder(tmp_path, left_out)
    results = load_results(task, folder.out)
    tables = shift_tables(results, folder)
    detection = tables["detection"]
    assert list(dict.fromkeys(detection["method"])) == list(METHODS)
    assert set(detection["n"]) == {2}  # seeds 0 and 1: the seeds with an ensemble of 5 soft runs
    auroc = [c for c in detection if c.startswith("AUROC")]
    assert auroc and (detection[auroc] == "100.00 ± 0.00").all().all()
    assert set(detection.loc[detection["method"] == "soft", "score"]) == {"1 - max p", "entropy"}
    assert set(detection.loc[detection["method"] == "ensemble", "score"]) == {"1 - max p", "entropy", "MI"}
    paired = tables["paired"]
    assert len(paired) == 4 * 3 and set(paired["baseline"]) == {"soft", "MC dropout", "ensemble"}
    assert paired[auroc[0]].str.startswith("+0.00 ± 0.00").all()
    assert tables["calibration"]["acc ID"].eq("100.00 ± 0.00").all()
    figures = risk_coverage_figures(task, results, folder, tmp_path / "rc.png")
    assert [p.name for p in figures] == ["rc_cora.png"] and figures[0].stat().st_size > 0
    if not left_out:
        assert reliability_figures(task, results, folder, tmp_path / "rel.png")[0].is_file()


def test_a_changed_prediction_changes_the_table(tmp_path):
    task, folder = fake_folder(tmp_path, 0)
    path = folder.run_dir("cora-wc-seed1") / SHIFT_FILE
    arrays = dict(np.load(path))
    arrays["flip0.05.attention.probs"] = arrays["id.attention.probs"]  # the shifted nodes as confident as the clean
    np.savez(path, **arrays)
    detection = shift_tables(load_results(task, folder.out), RunFolder(folder.out))["detection"]
    row = detection[(detection["method"] == "BAM-WC") & (detection["score"] == "entropy")].iloc[0]
    assert row["AUROC p=0.05"] != "100.00 ± 0.00" and row["AUROC p=0.01"] == "100.00 ± 0.00"


def test_the_ensemble_of_seed_k_pools_soft_seeds_k_to_k_plus_4(tmp_path):
    task, folder = fake_folder(tmp_path, 0)
    found = {(m, s): by_set for _, m, s, by_set in predictions(load_results(task, folder.out), folder)}
    for seed in (0, 1):
        members = [softmax(np.load(folder.run_dir(f"cora-soft-seed{k}") / SHIFT_FILE)["id.logits"].astype(np.float64), -1)
                   for k in range(seed, seed + ENSEMBLE)]
        assert np.allclose(found[("ensemble", seed)]["id"].probs, np.mean(members, 0))
    assert ("ensemble", 2) not in found


@pytest.mark.parametrize("variant,left_out", [("soft", 0), ("wc", 3)])
def test_ood_draws_of_a_tiny_run(tmp_path, data_root, variant, left_out):
    out = tmp_path / "out"
    gat_main(["--dataset", "cora", "--variant", variant, "--seeds", "0", "--max-epochs", "2", "--left-out", str(left_out),
              "--data-root", str(data_root), "--out", str(out), "--threads", "1", "--no-progress"])
    run = RunFolder(out).run_dir(f"cora-{variant}-seed0")
    assert ood.main([str(run), "--data-root", str(data_root), "--samples", "3"]) == [run / SHIFT_FILE]
    arrays = np.load(run / SHIFT_FILE)
    modes = ["mc_dropout"] if variant == "soft" else ["attention", "attention_dropout"]
    sizes = {"id": 684, "ood": 316} if left_out else {"id": 1000, "flip0.01": 1000, "flip0.05": 1000}
    expected = {f"{s}.{m}.{part}" for s in sizes for m in modes for part in ("probs", "mutual_info")} | {f"{s}.labels" for s in sizes}
    if variant == "soft":
        expected |= {"val.logits", "val.labels", *(f"{s}.logits" for s in sizes)}
    assert set(arrays.files) == expected
    classes = 7 - left_out
    for s, n in sizes.items():
        assert arrays[f"{s}.{modes[0]}.probs"].shape == (n, classes)
        assert np.allclose(arrays[f"{s}.{modes[0]}.probs"].astype(np.float64).sum(-1), 1, atol=1e-2)
        assert (arrays[f"{s}.{modes[0]}.mutual_info"] >= 0).all()
    if left_out:
        assert arrays["ood.labels"].min() >= classes and arrays["id.labels"].max() < classes
    else:
        assert not np.array_equal(arrays["id.mc_dropout.probs"], arrays["flip0.05.mc_dropout.probs"])
    assert not list(run.glob(".shift-*"))  # staged write: no partial file left
