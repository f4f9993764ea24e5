"""``python -m experiments.bench vqa`` measures both variants on one batch and prints one JSON line
(run here in this process: the fresh-process plumbing is shared with the other benchmarks and
tested there; a memory peak is only meaningful in a fresh process, so it is stubbed)."""

import json

from experiments.vqa import benchmark as vqa


def test_vqa_bench_prints_times_ratios_and_epoch_minutes(capsys, monkeypatch):
    monkeypatch.setattr(vqa, "in_fresh_process", lambda function, arguments, environment=None: function(*arguments))
    monkeypatch.setattr(vqa, "memory_measurement", lambda function, arguments, device: function(*arguments))
    monkeypatch.setattr(vqa, "measure_memory", lambda variant, *rest: {"peak_mb": {"soft": 40.0, "wc": 50.0}[variant], "rss_mb": 400.0})
    vqa.main(["--batch", "4", "--steps", "2", "--warmup", "0", "--train-images", "10"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["soft_ms"] > 0 and figures["bam_ms"] > 0
    assert abs(figures["time_ratio"] - figures["bam_ms"] / figures["soft_ms"]) < 0.01
    assert 0 < figures["train_questions"] < 100 and figures["steps_per_epoch"] == -(-figures["train_questions"] // 4)
    assert abs(figures["bam_epoch_minutes"] - figures["steps_per_epoch"] * figures["bam_ms"] / 60_000) < 0.01
    assert figures["mem_ratio"] == 1.25 and figures["bam_rss_mb"] == 400.0
