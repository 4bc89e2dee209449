"""The pipeline benchmark: its table, its ratios, and one small real run (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from paritykit.checks.pipeline.benchmark import BenchRow, BenchSettings, configurations, label
from paritykit.checks.pipeline.benchmark_report import format_table, save_benchmark
from paritykit.engine.builtin_models import DataSpec, ModelSpec
from paritykit.engine.pipeline_runs import PIPELINES

TINY = BenchSettings(
    model=ModelSpec(num_tables=2, num_embeddings=64, embedding_dim=8, sharding_types=("table_wise", "row_wise")),
    data=DataSpec(batch_size=4, num_batches=4), warmup_steps=1, rounds=1, pipelines=("fused:new",), memory_batches=3,
)


def test_every_torchrec_pipeline_runs_with_kjt_and_with_td_batches_by_default():
    pairs = configurations(BenchSettings().pipelines)
    assert len(pairs) == 2 * (len(PIPELINES) - 1)
    assert pairs[0] == ("sparse_dist", "kjt") and ("semi_sync", "td") in pairs
    with pytest.raises(ValueError, match=r"unknown pipeline\(s\) \['prefetch'\]"):
        configurations(("prefetch",))


def test_the_table_gives_each_row_its_percentiles_and_ratios_to_sparse_dist_with_kjt():
    rows = [
        BenchRow("sparse_dist", "kjt", step_s=[0.010, 0.020, 0.030, 0.040, 0.050], memory={"peak_rss_growth": 100 * 2**20}),
        BenchRow("semi_sync", "td", step_s=[0.005, 0.010, 0.015, 0.020, 0.025], memory={"peak_rss_growth": 150 * 2**20}),
    ]
    # Inclusive percentiles of five evenly spaced steps: P50 the middle one, P90 at 0.9 * 4 = 3.6 steps up.
    assert rows[0].percentile(50) == pytest.approx(0.030) and rows[0].percentile(90) == pytest.approx(0.046)
    lines = format_table(rows, TINY).splitlines()
    assert lines[1] == "ratios: to TrainPipelineSparseDist with KJT batches, measured in this run"
    assert "P90 ratio: 1.000" in lines[2] and "Peak RSS growth:     100.0 MiB (ratio 1.000)" in lines[2]
    assert lines[3].startswith("TrainPipelineSemiSync   | TD ")
    assert "Runtime (P50):    15.00 ms" in lines[3] and "P90 ratio: 0.500" in lines[3]
    assert "Peak RSS growth:     150.0 MiB (ratio 1.500)" in lines[3]


def test_fused_labels_name_the_lookup_stream_and_position():
    assert label("fused:new:after_dd") == "TrainPipelineFusedSparseDist (new stream, lookup after data dist)"
    assert label("fused:data_dist") == "TrainPipelineFusedSparseDist (data_dist stream, lookup before optimizer)"


@pytest.mark.slow  # a minute of fresh pools: `make bench` runs the benchmark itself; --run-slow or the release profile run this
def test_a_small_run_times_every_trained_step_and_measures_memory_in_fresh_pools(tmp_path):
    paths = save_benchmark(tmp_path, TINY)
    assert [p.name for p in paths] == ["pipeline_benchmark.md", "pipeline_benchmark.json"]
    rows = json.loads(paths[1].read_text())["rows"]
    assert [(r["pipeline"], r["input_type"]) for r in rows] == configurations(TINY.pipelines)
    # Four batches per run, the first left out as warm-up: three timed steps per round.
    assert all(len(row["step_s"]) == 3 and all(t > 0 for t in row["step_s"]) for row in rows)
    assert all(row["memory"]["peak_rss_growth"] > 0 for row in rows)
    table = paths[0].read_text()
    assert "TrainPipelineFusedSparseDist (new stream, lookup before optimizer) | TD" in table
    assert table.count(" | KJT | ") == 2 and table.count(" | TD  | ") == 2
