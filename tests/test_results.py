"""The docs' results tables are what the committed records give (experiments.results)."""

from __future__ import annotations

import itertools
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from experiments.catalog import load_task
from experiments.records import RunFolder
from experiments.results import (BENCH, DOCS, PUBLISHED, RECORDS, Table, add_runs, build, load_results, source_folder,
                                 table_markdown)
from experiments.runner import build_parser
from tests.readme_blocks import fenced_blocks

ROOT = Path(__file__).resolve().parents[1]
COMMITTED_RECORDS, COMMITTED_DOCS = ROOT / RECORDS, ROOT / DOCS
ACCURACY = next(spec for spec in PUBLISHED["gat"] if isinstance(spec, Table) and spec.name == "accuracy")


@pytest.mark.parametrize("task", sorted(PUBLISHED))
def test_committed_tables_regenerate_byte_for_byte(task, tmp_path):
    written = build(task, COMMITTED_RECORDS, tmp_path)
    tables = [spec.file for spec in PUBLISHED[task] if isinstance(spec, Table)]
    for file in tables:
        assert (tmp_path / file).read_bytes() == (COMMITTED_DOCS / file).read_bytes(), (
            f"docs/results/{file} is not what results/ gives: run python -m experiments.results {task}")
    figures = [path.name for path in written if path.suffix == ".png"]
    assert figures, "no figure drawn"
    for name in figures:
        assert (COMMITTED_DOCS / name).is_file(), f"docs/results/{name} is not committed"


def test_committed_bench_tables_regenerate_byte_for_byte(tmp_path):
    """Every bench with records under results/bench has its committed table, and only those."""
    written = build(BENCH, COMMITTED_RECORDS, tmp_path)
    assert sorted(path.name for path in written) == sorted(path.name for path in COMMITTED_DOCS.glob("bench_*.md")), (
        "docs/results/bench_*.md are not the benches of results/bench: run python -m experiments.results bench")
    for path in written:
        assert path.read_bytes() == (COMMITTED_DOCS / path.name).read_bytes(), (
            f"docs/results/{path.name} is not what results/bench gives: run python -m experiments.results bench")


def test_every_committed_table_is_published():
    published = {spec.file for specs in PUBLISHED.values() for spec in specs if isinstance(spec, Table)}
    assert {path.name for path in COMMITTED_DOCS.glob("*.md") if not path.name.startswith("bench_")} <= published


def edited_copy(tmp_path: Path, run: str, edit) -> Path:
    """A copy of results/gat whose record of ``run`` went through ``edit``."""
    folder = tmp_path / "gat"
    shutil.copytree(COMMITTED_RECORDS / "gat", folder)
    path = RunFolder(folder).run_dir(run) / "record.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    return folder


def test_a_changed_record_changes_its_table(tmp_path):
    task = load_task("gat")
    committed = load_results(task, COMMITTED_RECORDS / "gat")
    runs = committed[(committed["dataset"] == "cora") & (committed["variant"] == "wc")]
    folder = edited_copy(tmp_path, "cora-wc-seed0", lambda r: r["metrics"].update(test_acc=r["metrics"]["test_acc"] + 10))
    text = table_markdown(task, ACCURACY, load_results(task, folder))
    assert text != (COMMITTED_DOCS / ACCURACY.file).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| cora ") and "| wc " in line)
    assert f"| {runs['test_acc'].mean() + 10 / len(runs):.2f} ± " in row


def test_runs_of_other_settings_are_refused(tmp_path):
    folder = edited_copy(tmp_path, "cora-wc-seed0", lambda r: r["settings"].update(lr=0.01))
    with pytest.raises(ValueError, match="lr"):
        load_results(load_task("gat"), folder)


def test_added_runs_keep_records_with_history_and_probabilities_not_checkpoints(tmp_path):
    source = RunFolder(COMMITTED_RECORDS / "graph").run_dir("cora-wc-seed0")
    sweep = RunFolder(tmp_path / "sweep")
    record = json.loads((source / "record.json").read_text())
    record["training"]["history"] = [{"epoch": 0, "loss": 1.0}]
    sweep.save("cora-wc-seed0", record)
    for artifact in source.glob("*.npz"):
        shutil.copyfile(artifact, sweep.run_dir("cora-wc-seed0") / artifact.name)
    (sweep.run_dir("cora-wc-seed0") / "checkpoint.pt").write_bytes(b"weights")

    assert add_runs("gat", sweep.out, tmp_path / "results") == ["cora-wc-seed0"]
    added = tmp_path / "results" / "runs" / "cora-wc-seed0"
    kept = json.loads((added / "record.json").read_text())
    assert kept["training"] == record["training"]  # the per-epoch history included
    assert kept["metrics"] == record["metrics"] and kept["settings"] == record["settings"]
    assert sorted(p.name for p in added.iterdir()) == sorted(["record.json", *(p.name for p in source.glob("*.npz"))])
    with pytest.raises(ValueError, match="not 'vqa'"):
        add_runs("vqa", sweep.out, tmp_path / "other")


def documented_commands(page: Path) -> list[list[str]]:
    """The ``python -m experiments.<module> ...`` lines of the page's code blocks, as argument lists
    (from the module on; a comment cut off)."""
    commands = []
    for _, code in fenced_blocks(page):
        for line in code.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["python", "-m"] and len(words) > 2 and words[2].startswith("experiments."):
                commands.append(words[2:])
    return commands


def planned_runs(task_name: str, commands: list[list[str]], folder: str) -> dict[str, dict]:
    """The settings of every run the page's commands of ``task_name`` train into ``folder``, by run name."""
    task, planned = load_task(task_name), {}
    for module, *argv in commands:
        if module != f"experiments.{task_name}":
            continue
        parser, names = build_parser(task)
        args = parser.parse_args(argv)
        if args.out == folder:
            for panel, seed, variant in itertools.product(args.panels, args.seeds, args.variant):
                settings = task.settings_for(panel, variant, seed, {name: getattr(args, name) for name in names})
                planned[task.run_name(settings)] = json.loads(json.dumps(settings.row()))
    return planned


@pytest.mark.parametrize("page", ["docs/tasks/gat.md", "docs/tasks/uncertainty-shift.md", "docs/tasks/captioning.md",
                                  "docs/tasks/translation.md", "docs/reproducing.md", "docs/scaling.md"])
def test_the_pages_commands_train_the_committed_runs(page):
    """The sweeps a page shows before ``python -m experiments.results TASK --add SOURCE=FOLDER`` train
    exactly the runs committed in results/SOURCE, with their settings (those a record holds: a
    setting added since, such as GAT's ``seed_nodes``, was not one then)."""
    commands = documented_commands(ROOT / page)
    additions = [(argv[1], *source_folder(argv[i + 1])) for argv in commands if argv[0] == "experiments.results"
                 for i, word in enumerate(argv) if word == "--add"]
    assert additions, f"{page} shows no python -m experiments.results TASK --add SOURCE=FOLDER"
    for task_name, source, folder in additions:
        committed = {record["run"]: record["settings"] for record in RunFolder(COMMITTED_RECORDS / source).records()}
        planned = planned_runs(task_name, commands, str(folder))
        assert sorted(planned) == sorted(committed), f"{page}: the commands into {folder} train other runs"
        for run, settings in committed.items():
            assert {name: planned[run].get(name) for name in settings} == settings, f"{page}: {run} in {folder}"


def test_every_committed_table_is_shown_on_a_page():
    """A table built from records (a task's or a bench's) is included by some page of the docs."""
    included = {match for page in (ROOT / "docs").rglob("*.md")
                for match in re.findall(r'^--8<-- "docs/results/([^"]+)"', page.read_text(encoding="utf-8"), flags=re.M)}
    assert {path.name for path in COMMITTED_DOCS.glob("*.md")} - included == set()
