"""``python -m experiments.bench nmt`` runs end to end and prints the figures the README quotes."""

import json

import pytest

from experiments.bench import main as bench


@pytest.mark.slow  # fresh processes per model; run with make test-slow
def test_nmt_bench_prints_step_times_memory_and_ratios(capsys):
    bench(["nmt", "--preset", "tiny", "--batch", "4", "--length", "6", "--vocab", "50", "--steps", "2", "--warmup", "0",
           "--models", "exact", "va-sample"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("soft_ms", "bam_ms", "exact_ms", "va-sample_ms", "soft_peak_mb", "bam_peak_mb"):
        assert figures[key] > 0, key
    assert abs(figures["time_ratio"] - figures["bam_ms"] / figures["soft_ms"]) < 0.01
    assert abs(figures["mem_ratio"] - figures["bam_peak_mb"] / figures["soft_peak_mb"]) < 0.01
