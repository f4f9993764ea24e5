"""A bench run with ``--record`` keeps its figures with the command, the machine, the threads and the
versions, and ``python -m experiments.results bench`` rebuilds its table from that record."""

from __future__ import annotations

import json

import pytest
import torch

from experiments import bench, catalog, results
from experiments.bench_records import COLUMNS, bench_table, new_bench_record, read_bench_records, write_bench_record
from experiments.gat import benchmark as gat_bench
from experiments.records import versions
from experiments.runner.benchmarking import in_fresh_process, operator_profile


def test_a_recorded_bench_rebuilds_its_table_from_the_record(tmp_path, data_root):
    records = tmp_path / "results"
    rows = bench.main(["predictive", "--untrained", "--samples", "2", "--chunk", "2", "--repeats", "1",
                       "--data-root", str(data_root), "--checkpoint", str(tmp_path / "unused.pt"),
                       "--record", "tiny", "--records", str(records / "bench")])
    record = json.loads((records / "bench" / "predictive" / "tiny.json").read_text())
    assert record["rows"] == rows and record["threads"] == 1
    assert record["command"].startswith("python -m experiments.bench predictive --untrained ")
    assert "--record" not in record["options"] and "--samples" in record["options"]
    assert record["versions"] == versions() and record["machine"]["cores"] >= 1 and record["machine"]["cpu"]

    written = results.build("bench", records, tmp_path / "docs")
    assert [path.name for path in written] == ["bench_predictive.md"]
    row = next(line for line in written[0].read_text().splitlines() if line.startswith("| `tiny` "))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    header = [cell.strip() for cell in written[0].read_text().splitlines()[2].strip("|").split("|")]
    shown = dict(zip(header, cells))
    assert shown["seconds"] == str(rows[0]["seconds"]) and shown["peak_mb"] == str(rows[0]["peak_mb"])
    assert shown["options"].startswith("`--untrained --samples 2") and shown["threads"] == "1"


def bert_record(**changes) -> dict:
    rows = [{"batch": 16, "length": 128, "threads": 1, "soft_ms": 2303.0, "bam_ms": 2723.0, "time_ratio": 1.17,
             "time_ratio_iqr": [1.13, 1.22], "mem_ratio": 0.87},
            {"batch": 4, "length": 512, "threads": 1, "soft_ms": 5294.0, "bam_ms": 4987.0, "time_ratio": 0.95,
             "time_ratio_iqr": [0.91, 0.98], "mem_ratio": 0.51}]
    record = {"bench": "bert", "command": "python -m experiments.bench bert --shapes 16x128 4x512 --record fused",
              "options": ["--shapes", "16x128", "4x512"], "machine": {"cpu": "CPU", "cores": 2}, "threads": 1,
              "load_average": {"before": [0.5, 0.4, 0.3], "after": [1.0, 0.5, 0.3]}, "versions": {},
              "finished": "2026-11-28T10:00:00+0000", "rows": rows}
    return {**record, **changes}


def test_a_table_has_a_row_per_printed_line_with_the_interquartile_range_beside_the_ratio():
    lines = bench_table("bert", {"fused": bert_record()}).splitlines()
    header = [cell.strip() for cell in lines[2].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[4:]]
    assert [(r["length"], r["time_ratio"], r["mem_ratio"]) for r in rows] == [("128", "1.17 [1.13, 1.22]", "0.87"),
                                                                               ("512", "0.95 [0.91, 0.98]", "0.51")]
    assert "time_ratio_iqr" not in header and "soft_peak_mb" not in header  # no record holds it
    assert rows[0]["options"] == "`--shapes 16x128 4x512`" and rows[0]["load before"] == "0.5"


def test_a_record_name_that_is_no_file_stem_is_refused_before_the_bench_runs(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["predictive", "--record", "../elsewhere"])
    assert stop.value.code == 2 and "record name '../elsewhere'" in capsys.readouterr().err


def test_a_damaged_record_is_named(tmp_path):
    folder = tmp_path / "bench" / "bert"
    folder.mkdir(parents=True)
    (folder / "fused.json").write_text(json.dumps(bert_record()))
    (folder / "cut.json").write_text(json.dumps(bert_record())[:40])
    with pytest.raises(ValueError, match="cut.json: not JSON"):
        read_bench_records(folder)
    (folder / "cut.json").write_text(json.dumps(bert_record(bench="vqa")))
    with pytest.raises(ValueError, match="cut.json: not a record of bench 'bert'"):
        results.build("bench", tmp_path, tmp_path / "docs")
    (folder / "cut.json").write_text(json.dumps({k: v for k, v in bert_record().items() if k != "machine"}))
    with pytest.raises(ValueError, match="cut.json: a record of bench 'bert' without machine"):
        read_bench_records(folder)


def test_a_records_folder_that_cannot_be_written_is_refused_before_the_bench_runs(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stop:
        bench.main(["predictive", "--record", "x", "--records", str(tmp_path / "file")])
    assert stop.value.code == 2 and "--records" in capsys.readouterr().err


def test_the_declared_columns_are_those_of_benches():
    assert set(COLUMNS) <= set(catalog.benchmarks())


def test_a_bench_without_declared_columns_shows_every_figure_it_printed():
    rows = [{"threads": 2, "toy_ms": 1.5}, {"threads": 2, "toy_ms": 1.7, "toy_peak_mb": 3.0}]
    lines = bench_table("toy", {"run": bert_record(bench="toy", rows=rows, threads=2)}).splitlines()
    assert lines[2].startswith("| record | options | toy_ms | toy_peak_mb | threads |")
    assert lines[5].startswith("| `run` | `--shapes 16x128 4x512` | 1.7 | 3.0 | 2 |")
    with pytest.raises(ValueError, match="returned no figures"):
        new_bench_record("toy", [], [], [None], (0.0, 0.0, 0.0))


def test_an_operator_profile_puts_first_where_the_second_model_spends_more():
    a, b = torch.randn(200, 200), torch.randn(400_000)
    steps = {"soft": lambda: a @ a, "wc": lambda: (a @ a, torch.sort(b))}
    profile = operator_profile(steps, 2, ("soft", "wc"), top=5)
    first = profile["operators"][0]
    assert first["operator"] == "aten::sort" and first["soft"] == 0.0 and first["wc"] > 0.0
    assert profile["self_ms"]["wc"] > profile["self_ms"]["soft"] > 0.0
    mm = next(op for op in profile["operators"] if op["operator"] == "aten::mm")
    assert mm["soft"] > 0.0 and mm["wc"] > 0.0  # both models' time of an operator both use
    assert profile["operators"][-1]["operator"] == "(other operators)"
    for model in ("soft", "wc"):  # the listed operators and the rest make up the step
        assert sum(op[model] for op in profile["operators"]) == pytest.approx(profile["self_ms"][model], abs=0.01)


def test_a_profiled_bench_records_its_profile_and_rebuilds_a_table_of_it(tmp_path):
    """The GAT bench's timing process with ``--profile 1`` (in a fresh process, as the bench runs it:
    run in the test process, it left state that broke later tests' ``torch.compile`` graphs, cause
    not isolated), its profile in a record, and the profile's table that ``experiments.results``
    builds."""
    timing = in_fresh_process(gat_bench.measure_time,
                              (["soft", "wc"], gat_bench.GraphSize(60, 300, 8, None), 1, 1, True, False, "cpu", 1))
    profile = timing["profile"]
    assert profile["compare"] == ["soft", "wc"] and set(profile["self_ms"]) == {"soft", "wc"}
    assert any(op["wc"] > 0.0 and op["soft"] == 0.0 for op in profile["operators"])  # the Weibull draw's, the KL's: BAM-WC's own
    row = {"graph": timing["graph"], "threads": 1, "soft_ms": 1.0, "bam_ms": 2.0, "profile": profile}
    options = ["--nodes", "60", "--edges", "300", "--profile", "1"]
    write_bench_record(tmp_path / "bench", "p", new_bench_record("gat", options, options, [row], (0.1, 0.1, 0.1)))
    written = results.build("bench", tmp_path, tmp_path / "docs")
    assert [path.name for path in written] == ["bench_gat.md", "bench_gat_profile.md"]
    text = written[1].read_text()
    assert "`p` (`--nodes 60 --edges 300 --profile 1`; graph " in text
    assert "| operator | soft ms (share) | wc ms (share) | wc - soft ms | % of soft's step |" in text
    assert "aten::" not in written[0].read_text() and "aten::" in text  # the figures' table leaves the profile to its own


def test_a_profile_the_bench_cannot_take_ends_in_one_line(capsys):
    for argv, message in ((["vqa", "--profile", "2", "--device", "cuda"], "--profile times CPU operators; not with --device cuda"),
                          (["gat", "--profile", "1", "--compile"], "--profile profiles the eager steps; not with --compile")):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["gat", "--profile", "-1"])
    assert exit_info.value.code == 2 and "argument --profile: must be at least 0, got -1" in capsys.readouterr().err
