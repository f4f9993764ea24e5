"""The record of a benchmark run, and the docs tables drawn from the committed ones.

    python -m experiments.bench gat --steps 60 --record cora      # -> results/bench/gat/cora.json
    python -m experiments.results bench                           # -> docs/results/bench_<bench>.md

A record holds what a figure needs to be checked and compared: the command line, the machine (CPU
model, cores, GPU if one is used), the thread count, the load average before and after, the
package versions and source commit (:func:`experiments.records.versions`, as a run's record), and
the figures the command printed (``rows``: one per printed JSON line; ``bench bert`` prints one
per shape). Each bench's table (:data:`COLUMNS`) has one row per printed line of every record of
that bench, records in name order, so the same records give the same Markdown.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from experiments.records import versions

BENCH_RECORDS = Path("results/bench")
#: a record's name: the stem of its file, which the docs cite
RECORD_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
#: per bench, the figures its table shows, in order (a figure no record holds gets no column;
#: ``<figure>_iqr`` or ``<figure>_range``, when printed, is shown beside it in brackets); a bench
#: not listed shows every figure it printed
COLUMNS: dict[str, tuple[str, ...]] = {
    "gat": ("graph", "steps", "gatconv_ms", "soft_ms", "bam_ms", "gatconv_peak_mb", "soft_peak_mb", "bam_peak_mb",
            "time_ratio", "mem_ratio", "soft_compiled_ms", "bam_compiled_ms", "soft_compiled_over_eager",
            "bam_compiled_over_eager", "soft_step_compiled_ms", "bam_step_compiled_ms", "soft_step_compiled_over_eager",
            "bam_step_compiled_over_eager", "bam_step_over_network_compiled", "bam_over_soft_eager", "bam_over_soft_compiled"),
    "gat-minibatch": ("graph", "batch_size", "num_neighbors", "steps", "full_ms", "minibatch_ms", "full_peak_mb",
                      "minibatch_peak_mb", "mem_ratio"),
    "predictive": ("trained", "samples", "chunk", "nodes", "seconds", "cpu_seconds", "peak_mb", "propagate_seconds",
                   "propagate_peak_mb", "propagate_over_bags"),
    "bert": ("model", "batch", "length", "steps", "path", "compiled", "compiled_noise", "soft_ms", "bam_ms", "soft_peak_mb",
             "bam_peak_mb", "time_ratio", "mem_ratio", "soft_compiled_over_eager", "bam_compiled_over_eager"),
    "nmt": ("preset", "batch", "length", "vocab", "soft_ms", "bam_ms", "soft_peak_mb", "bam_peak_mb", "time_ratio", "mem_ratio",
            "hard_ms", "va-sample_ms", "va-relaxed_ms", "exact_ms", "hard-enum_ms", "va-enum_ms"),
    "vqa": ("batch", "train_questions", "soft_ms", "bam_ms", "soft_peak_mb", "bam_peak_mb", "time_ratio", "mem_ratio",
            "soft_epoch_minutes", "bam_epoch_minutes"),
    "captioning": ("batch", "steps", "soft_ms", "bam_ms", "soft_peak_mb", "bam_peak_mb", "time_ratio", "mem_ratio"),
}
#: what every record holds
RECORD_ENTRIES = ("bench", "command", "options", "machine", "threads", "load_average", "versions", "finished", "rows")
#: what a printed figure may come with, shown beside it
SPREADS = ("_iqr", "_range")


def record_name(text: str) -> str:
    """``--record NAME``: a file stem of lower-case letters, digits, ``.``, ``_`` and ``-``."""
    if not RECORD_NAME.fullmatch(text):
        raise ValueError(f"record name {text!r}: use lower-case letters, digits, '.', '_' and '-' (it names a file)")
    return text


def machine(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The CPU's model and cores, the system, and the GPU's name when a row ran on one."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = models[0] if models else cpu
    found: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform()}
    devices = sorted({str(row["device"]) for row in rows if str(row.get("device", "cpu")).startswith("cuda")})
    if devices:
        import torch

        found["gpu"] = {device: torch.cuda.get_device_name(device) for device in devices}
    return found


def new_bench_record(bench: str, argv: Sequence[str], options: Sequence[str], rows: Sequence[Mapping[str, Any]],
                     load_before: Sequence[float]) -> dict[str, Any]:
    """The record of ``python -m experiments.bench <bench> <argv>``, which printed ``rows``;
    ``options``: the bench's own options among ``argv`` (without the recording ones).
    Raises ``ValueError`` if the rows do not say one thread count."""
    if not rows or not all(isinstance(row, Mapping) for row in rows):
        raise ValueError(f"bench {bench} returned no figures (its main(argv) must return what it printed): nothing recorded")
    threads = {row.get("threads") for row in rows}
    if len(threads) != 1 or None in threads:
        raise ValueError(f"bench {bench} printed no single thread count ({sorted(map(str, threads))}): nothing recorded")
    return {
        "bench": bench, "command": shlex.join(["python", "-m", "experiments.bench", bench, *argv]),
        "options": list(options),
        "machine": machine(rows), "threads": threads.pop(),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "versions": versions(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": [dict(row) for row in rows],
    }


def write_bench_record(folder: Path, name: str, record: Mapping[str, Any]) -> Path:
    """Write ``record`` to ``<folder>/<bench>/<name>.json`` (replacing a record of that name)."""
    path = folder / record["bench"] / f"{record_name(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, path)
    return path


def read_bench_records(folder: Path) -> dict[str, dict[str, Any]]:
    """The records of one bench (``<records>/<bench>``), by name, in name order. A file that is not
    a bench record raises ``ValueError`` naming it."""
    records = {}
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error}); re-run the command that wrote it") from None
        if not isinstance(record, dict) or record.get("bench") != folder.name or not record.get("rows"):
            raise ValueError(f"{path}: not a record of bench {folder.name!r} with printed figures")
        missing = [entry for entry in RECORD_ENTRIES if entry not in record]
        if missing:
            raise ValueError(f"{path}: a record of bench {folder.name!r} without {', '.join(missing)}")
        records[path.stem] = record
    return records


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict) and set(value) == {"median", "iqr"}:  # a paired ratio of the GAT bench
        return f"{value['median']} {_cell(value['iqr'])}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_cell, value)) + "]"
    return str(value)


def _figure(row: Mapping[str, Any], column: str) -> str:
    """The row's ``column``, with its interquartile range or range beside it when printed."""
    text = _cell(row.get(column))
    spread = next((row[column + s] for s in SPREADS if row.get(column + s) is not None), None)
    return f"{text} {_cell(spread)}" if text and spread is not None else text


def bench_table(bench: str, records: Mapping[str, Mapping[str, Any]]) -> str:
    """The Markdown table of ``records`` (by name) of one bench, with a comment naming its command."""
    if not records:
        raise ValueError(f"no records of bench {bench!r}")
    rows = [(name, record, row) for name, record in records.items() for row in record["rows"]]
    printed = list(dict.fromkeys(key for _, _, row in rows for key in row if key != "threads"))
    columns = [c for c in COLUMNS.get(bench, printed) if any(row.get(c) is not None for _, _, row in rows)]
    header = ["record", "options", *columns, "threads", "machine", "load before", "date"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, record, row in rows:
        options = shlex.join(record["options"])
        cpu = record["machine"]
        where = f"{cpu['cpu']}, {cpu['cores']} cores" + "".join(f", {gpu}" for gpu in cpu.get("gpu", {}).values())
        cells = [f"`{name}`", f"`{options}`" if options else "", *(_figure(row, c) for c in columns), str(record["threads"]),
                 where, str(record["load_average"]["before"][0]), record["finished"][:10]]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    note = f"<!-- python -m experiments.results bench: the records of results/bench/{bench}; do not edit -->"
    return note + "\n\n" + "\n".join(lines) + "\n"


def profile_tables(bench: str, records: Mapping[str, Mapping[str, Any]]) -> str:
    """The Markdown of the operator profiles the records of one bench hold (``--profile``), one
    table per profiled row: each operator's self CPU time per step in each model (ms, and its share
    of that model's profiled step) and what the second compared model spends more than the first,
    as a share of the first's step; empty when no record holds a profile."""
    parts = []
    for name, record in records.items():
        for row in record["rows"]:
            profile = row.get("profile")
            if not profile:
                continue
            models, (baseline, bam) = list(profile["self_ms"]), profile["compare"]
            total = profile["self_ms"]
            steps = ", ".join(f"{m} {total[m]:.1f} ms" for m in models)
            shape = ", ".join(f"{k} {_cell(row[k])}" for k in ("graph", "model", "batch", "length") if row.get(k) is not None)
            parts.append(f"`{name}` (`{shlex.join(record['options'])}`{'; ' + shape if shape else ''}): {profile['steps']} "
                         f"profiled steps of each; self CPU time a step: {steps}; {bam} - {baseline}: "
                         f"{total[bam] - total[baseline]:+.1f} ms ({100 * (total[bam] - total[baseline]) / total[baseline]:+.1f}% "
                         f"of {baseline}'s step)\n")
            header = ["operator", *(f"{m} ms (share)" for m in models), f"{bam} - {baseline} ms", f"% of {baseline}'s step"]
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for op in profile["operators"]:
                gap = op[bam] - op[baseline]
                cells = [f"`{op['operator']}`", *(f"{op[m]:.2f} ({100 * op[m] / total[m]:.1f}%)" for m in models),
                         f"{gap:+.2f}", f"{100 * gap / total[baseline]:+.1f}"]
                lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
            parts.append("\n".join(lines) + "\n")
    if not parts:
        return ""
    note = f"<!-- python -m experiments.results bench: the profiles in the records of results/bench/{bench}; do not edit -->"
    return note + "\n\n" + "\n".join(parts)


def build_bench_tables(records: Path, out: Path) -> list[Path]:
    """``<out>/bench_<bench>.md`` for every bench with records under ``records`` (``results/bench``),
    and ``bench_<bench>_profile.md`` for those whose records hold operator profiles; returns the
    files written."""
    written = []
    for folder in sorted(p for p in records.iterdir() if p.is_dir()) if records.is_dir() else []:
        found = read_bench_records(folder)
        if found:
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"bench_{folder.name}.md"
            path.write_text(bench_table(folder.name, found))
            written.append(path)
            profiles = profile_tables(folder.name, found)
            if profiles:
                path = out / f"bench_{folder.name}_profile.md"
                path.write_text(profiles)
                written.append(path)
    return written

