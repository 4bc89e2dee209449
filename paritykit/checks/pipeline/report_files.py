"""The pipeline check's report files: per-step diff tables (CSV, Markdown) and a drift plot per pair."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from paritykit.checks.pipeline.comparison import REFERENCE, PairComparison, PipelineParityResult, fmt_list


def write_report(result: PipelineParityResult, directory: Path, prefix: str = "pipeline") -> list[Path]:
    """Per-step max-abs-diff table (CSV and Markdown) and one drift plot (PNG) per pipeline pair."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [_write_csv(result, directory / f"{prefix}_diffs.csv"), _write_markdown(result, directory / f"{prefix}_diffs.md")]
    for comparison in result.comparisons:
        written.append(_write_plot(comparison, directory / f"{prefix}_drift_{_file_safe(comparison.candidate)}_vs_{_file_safe(comparison.reference)}.png"))
    return written


def _file_safe(name: str) -> str:
    return name.replace(":", "-").replace("[", "-").replace("]", "")


def _rows(result: PipelineParityResult) -> list[list[Any]]:
    rows = []
    for c in result.comparisons:
        for step, (out, loss) in enumerate(zip(c.output_diff, c.loss_diff)):
            rows.append([c.candidate, c.reference, step, out, loss])
    return rows


def _write_csv(result: PipelineParityResult, path: Path) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["pipeline", "reference", "step", "max_abs_output_diff", "max_abs_loss_diff"])
        writer.writerows(_rows(result))
    return path


def _write_markdown(result: PipelineParityResult, path: Path) -> Path:
    lines = [f"# Pipeline parity: {result.label}", ""]
    if result.anchor:
        lines += [f"Unsharded anchor (the `{REFERENCE}` loop over DMP vs the unsharded model): {result.anchor}", ""]
    lines += ["| pipeline | reference | steps | per-step max abs output diff | tables + dense params | fused opt state | dense opt state | NE diff |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in result.comparisons:
        final = c.final_diff
        lines.append(
            f"| {c.candidate} | {c.reference} | {c.candidate_steps}/{c.reference_steps} | {fmt_list(c.output_diff)} | "
            f"{final['state']:.3g} | {final['fused_state']:.3g} | {final['dense_state']:.3g} | {c.ne_difference:.3g} |"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_plot(comparison: PairComparison, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3))
    axes = figure.add_subplot()
    steps = list(range(len(comparison.output_diff)))
    axes.plot(steps, comparison.output_diff, marker="o", label="max |output diff|")
    axes.plot(steps, comparison.loss_diff, marker="x", label="max |loss diff|")
    axes.set_xlabel("step")
    axes.set_ylabel("max abs diff")
    axes.set_title(f"{comparison.candidate} vs {comparison.reference}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    return path
