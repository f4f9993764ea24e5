"""Turn a finished run folder into a Markdown report: tables, diagnostics and figures.

    python -m analysis.report RUN_DIR          writes RUN_DIR/report.md

Reads what the task scripts leave in an output folder: ``table.md`` (the tables), the figures of
the sweep (``figures/*.png``) and of each run (``runs/<run>/figures/*.png``), and each run's ArviZ
diagnostics (``runs/<run>/diagnostics/*-diagnostics.json`` and ``*-summary.csv``).
Image links are relative, so the report renders wherever the folder is copied.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import pandas as pd

#: figure file suffix -> caption
CAPTIONS = {
    "variants": "Test accuracy, ECE and PAvPU@0.05 per variant and sampling mode (mean ± std over seeds).",
    "reliability": "Reliability diagram of the test nodes (15 equal-width confidence bins).",
    "forest": "Posterior attention into one test node, every head of the first layer (94% HDI, chains combined).",
    "training-curves": "Validation loss and accuracy per epoch, one line per run; dots: the epochs early stopping kept (the last that set an accuracy record and a loss low together).",
    "prior-posterior": "Prior vs posterior attention of the same node (output layer). Prior: the contextual prior's location Psi normalized over the neighbourhood, per draw (it depends on the first layer's attention samples); posterior: attention weight draws from q(S | Phi).",
}


def _figures(run: Path) -> list[str]:
    lines = []
    for png in [*sorted((run / "figures").glob("*.png")), *sorted(run.glob("runs/*/figures/*.png"))]:
        kind = next((k for k in CAPTIONS if png.stem.endswith(k)), None)
        name = png.relative_to(run).as_posix()
        lines += [f"![{png.stem}]({name})", "", f"*{name}*: {CAPTIONS.get(kind, '')}", ""]
    return lines


def _diagnostics(run: Path) -> list[str]:
    lines = []
    for info_file in sorted(run.glob("runs/*/diagnostics/*-diagnostics.json")):
        name = f"{info_file.parents[1].name}: {info_file.name.removesuffix('-diagnostics.json')}"
        info = json.loads(info_file.read_text())
        lines += [
            f"### {name}", "",
            f"Queries (nodes, questions or target steps) {info['queries']}, {info['chains']} independent chains (chain c seeded with the run's seed + c) x {info['draws']} draws. "
            f"{info['entries']} attention entries summarized; {info['constant_entries']} constant entries "
            f"excluded (R-hat undefined). Smallest bulk ESS {info['ess_bulk_min']:.0f}, largest R-hat "
            f"{info['r_hat_max']:.3f}. The draws are independent (amortized variational posterior), so "
            "ESS near the number of draws and R-hat near 1 are expected: they check the sampling code, "
            "not mixing.", "",
        ]
        summary_file = info_file.with_name(info_file.name.replace("-diagnostics.json", "-summary.csv"))
        if summary_file.exists():
            summary = pd.read_csv(summary_file)
            first = summary[summary["query"] == summary["query"].iloc[0]].head(12)
            lines += [f"First rows of `{summary_file.name}` (query {first['query'].iloc[0]}):", "", first.to_markdown(index=False, floatfmt=".3f"), ""]
    return lines


def build_report(run: Path) -> str:
    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(f"run folder {run} does not exist")
    table = run / "table.md"
    if not table.exists():
        raise FileNotFoundError(f"{table} not found: is {run} a finished run folder?")
    lines = [f"# Results: `{run.name}`", "", "## Results table", "", table.read_text().strip(), ""]
    diagnostics = _diagnostics(run)
    if diagnostics:
        lines += ["## Attention diagnostics (ArviZ)", ""] + diagnostics
    figures = _figures(run)
    if figures:
        lines += ["## Figures", ""] + figures
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    args = p.parse_args(argv)
    path = args.run_dir / "report.md"
    path.write_text(build_report(args.run_dir))
    print(path)
    return path


if __name__ == "__main__":
    main()
