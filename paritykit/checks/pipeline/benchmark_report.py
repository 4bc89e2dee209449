"""The pipeline benchmark as a table (the shape of the fused-pipeline PR's readings), and the function
the gate calls to save it into a report directory."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from paritykit.checks.pipeline.benchmark import BASELINE, BenchRow, BenchSettings, label, run_benchmark

MIB = 1024 * 1024


def _memory_columns(rows: list[BenchRow]) -> list[tuple[str, str]]:
    """(memory key, column title) present in the rows."""
    titles = {"peak_rss_growth": "Peak RSS growth", "peak_allocated": "Peak memory alloc", "peak_reserved": "Peak memory reserved"}
    present = [key for key in titles if any(key in row.memory for row in rows)]
    return [(key, titles[key]) for key in present]


def _ratio(value: float, baseline: float) -> str:
    if not baseline or math.isnan(value) or math.isnan(baseline):
        return "-"
    return f"{value / baseline:.3f}"


def describe(settings: BenchSettings) -> str:
    m, d = settings.model, settings.data
    return (
        f"{m.kind}: {m.num_tables}+{m.num_weighted_tables} tables of {m.num_embeddings} x {m.embedding_dim} "
        f"({'/'.join(m.sharding_types)}, fused {m.fused_optimizer}), MLP width {m.hidden_dim}; batch {d.batch_size} per rank, "
        f"{d.num_batches} batches per run ({settings.warmup_steps} warm-up steps left out), {settings.rounds} rounds, "
        f"{settings.world_size} ranks on {settings.device}"
    )


def format_table(rows: list[BenchRow], settings: BenchSettings) -> str:
    """One line per pipeline and input: runtime P50/P90 per step, peak memory, ratios to SparseDist (KJT)."""
    base = next(row for row in rows if (row.pipeline, row.input_type) == BASELINE)
    memory = _memory_columns(rows)
    width = max(len(label(row.pipeline)) for row in rows)
    lines = [f"pipeline benchmark, {describe(settings)}", "ratios: to TrainPipelineSparseDist with KJT batches, measured in this run"]
    for row in rows:
        cells = [
            f"{label(row.pipeline):<{width}}", f"{row.input_type.upper():<3}",
            f"Runtime (P50): {row.percentile(50) * 1000:8.2f} ms", f"Runtime (P90): {row.percentile(90) * 1000:8.2f} ms",
            f"P90 ratio: {_ratio(row.percentile(90), base.percentile(90))}",
        ]
        for key, title in memory:
            value = row.memory.get(key, math.nan)
            cells.append(f"{title}: {value / MIB:9.1f} MiB (ratio {_ratio(value, base.memory.get(key, math.nan))})")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def save_benchmark(report_dir: Path | str, settings: BenchSettings = BenchSettings(), progress: Any = None) -> list[Path]:
    """Run the benchmark and write ``pipeline_benchmark.md`` (the table) and ``.json`` (every step)."""
    directory = Path(report_dir)
    directory.mkdir(parents=True, exist_ok=True)
    rows = run_benchmark(settings, progress)
    table = directory / "pipeline_benchmark.md"
    table.write_text("```\n" + format_table(rows, settings) + "\n```\n")
    raw = directory / "pipeline_benchmark.json"
    raw.write_text(json.dumps({"settings": describe(settings), "rows": [asdict(row) for row in rows]}, indent=1))
    return [table, raw]
