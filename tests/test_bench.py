"""The GAT benchmark command runs end to end and prints the figures the README quotes."""

import json

from experiments.benchmarks import gat


def test_gat_bench_prints_times_memory_and_ratios(capsys):
    gat.main(["--nodes", "60", "--edges", "240", "--features", "8", "--steps", "2", "--threads", "1"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("gatconv_ms", "soft_ms", "bam_ms", "time_ratio", "gatconv_peak_mb", "bam_peak_mb", "mem_ratio"):
        assert figures[key] >= 0, key
    assert abs(figures["time_ratio"] - figures["bam_ms"] / figures["gatconv_ms"]) < 0.01
