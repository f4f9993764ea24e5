"""The benchmark commands run end to end and print the figures the README quotes."""

import json
import os

import pytest
import torch

from experiments.gat import benchmark as gat
from experiments.gat import benchmark_predictive as predictive
from experiments.glue import benchmark as bert
from experiments.runner import benchmarking as process


@pytest.mark.slow  # fresh processes per model; run with make test-slow
def test_gat_bench_prints_times_memory_and_ratios(capsys):
    gat.main(["--nodes", "60", "--edges", "240", "--features", "8", "--steps", "2", "--threads", "1"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("gatconv_ms", "soft_ms", "bam_ms", "time_ratio", "gatconv_peak_mb", "bam_peak_mb", "mem_ratio"):
        assert figures[key] >= 0, key
    assert abs(figures["time_ratio"] - figures["bam_ms"] / figures["gatconv_ms"]) < 0.01
    low, high = figures["bam_over_soft_eager"]["iqr"]  # BAM-WC over soft, per pair of back-to-back steps
    assert 0 < low <= figures["bam_over_soft_eager"]["median"] <= high


def test_paired_ratios_divide_back_to_back_steps_not_medians():
    """A step slowed for both models by the machine (the second pair) is one ratio of 1, not a
    shift of either median: per pair 2, 1, 3, 2 -> median 2 (the ratio of the medians would be
    3.5 / 1.5 = 2.33), quartiles 1.25 and 2.75 (``statistics.quantiles``' exclusive method)."""
    assert gat.paired_ratio([2.0, 10.0, 3.0, 4.0], [1.0, 10.0, 1.0, 2.0]) == {"median": 2.0, "iqr": [1.25, 2.75]}
    assert gat.paired_ratio([3.0], [2.0]) == {"median": 1.5, "iqr": [1.5, 1.5]}


def test_gat_bench_raises_its_measuring_process_error(tmp_path):
    """Missing data is named, not replaced by a random graph; the error crosses the process boundary."""
    with pytest.raises(FileNotFoundError, match=r"Planetoid Cora: missing ind\.cora\.x"):
        gat.main(["--data-root", str(tmp_path), "--steps", "1", "--threads", "1", "--models", "soft"])


@pytest.mark.slow  # fresh processes per model; run with make test-slow
def test_bert_bench_prints_times_memory_and_ratios(capsys, tiny_bert_folder):
    bert.main(["--model", str(tiny_bert_folder), "--batch", "2", "--length", "16", "--steps", "2", "--warmup", "0"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("soft_ms", "bam_ms", "soft_peak_mb", "bam_peak_mb"):
        assert figures[key] > 0, key
    low, high = figures["time_ratio_iqr"]  # the median of per-step ratios, inside their quartiles
    assert 0 < low <= figures["time_ratio"] <= high
    assert abs(figures["mem_ratio"] - figures["bam_peak_mb"] / figures["soft_peak_mb"]) < 0.01


@pytest.mark.slow  # Inductor compiles two tiny BERTs
def test_compiled_bert_bench_times_both_eager_models_in_the_same_round(tiny_bert_folder):
    timing = bert.measure_time(str(tiny_bert_folder), 1, 2, 16, 3, 1, 1, 10.0, True, True, False)
    for name in ("soft", "bam"):
        ratios = timing[f"{name}_compiled_over_eager"]
        assert len(ratios) == len(timing["ratios"]) == 3 and timing[f"{name}_eager_ms"] > 0
        summary = bert.ratio_summary(ratios, "r")
        assert summary["r_iqr"][0] <= summary["r"] <= summary["r_iqr"][1]


def test_predictive_bench_samples_a_saved_model_in_a_fresh_process(tmp_path, cora, data_root):
    import torch

    from experiments.gat.task import TASK, build_model

    data, num_features, num_classes = cora
    checkpoint = tmp_path / "wc.pt"
    torch.save(build_model(TASK.settings_for("cora", "wc", 0, {}), num_features, num_classes).state_dict(), checkpoint)
    figures = predictive.main(["--samples", "3", "--chunk", "2", "--repeats", "2", "--data-root", str(data_root),
                               "--checkpoint", str(checkpoint)])
    assert figures["nodes"] == data.num_nodes and len(figures["seconds_all"]) == 2
    assert len(figures["propagate_seconds_all"]) == len(figures["propagate_over_bags_all"]) == 2  # both paths, in turn
    assert figures["propagate_over_bags"] > 0 and figures["propagate_peak_mb"] >= 0
    assert figures["layers"] == ["conv1.attention", "conv2.attention"]
    assert figures["peak_mb"] > 0


def test_memory_is_measured_in_a_fresh_process_on_the_cpu():
    assert process.memory_measurement(os.getpid, (), "cpu") != os.getpid()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_is_measured_in_this_process():
    assert process.memory_measurement(os.getpid, (), "cuda") == os.getpid()


def test_untrained_predictive_bench_leaves_the_trained_checkpoint_alone(tmp_path, data_root):
    checkpoint = tmp_path / "trained.pt"
    figures = predictive.main(["--untrained", "--samples", "2", "--chunk", "2", "--repeats", "1", "--data-root", str(data_root),
                               "--checkpoint", str(checkpoint)])
    assert figures["trained"] is False and figures["seconds"] > 0 and not checkpoint.exists()
