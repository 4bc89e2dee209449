"""The pipeline check as the gate runs it: report files, run(config, pools), the hypothesis matrix."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest
from hypothesis import given, settings

from paritykit.checks import pipeline as pipeline_check
from paritykit.checks.pipeline import matrix
from paritykit.checks.pipeline.assertion import ALL_PIPELINES
from paritykit.checks.runner import GateConfig
from paritykit.engine.builtin_models import DataSpec, ModelSpec
from paritykit.engine.pipeline_runs import RunSpec


@pytest.mark.world_size(1)
def test_report_dir_gets_a_per_step_diff_table_and_a_drift_plot_per_pair(rank_pool, tmp_path):
    spec = RunSpec(model=ModelSpec(fused_optimizer="adagrad"), data=DataSpec(num_batches=4))
    pipeline_check.assert_pipeline_parity(rank_pool, spec, ("fused:data_dist", "semi_sync"), report_dir=tmp_path)

    with (tmp_path / "pipeline_diffs.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["pipeline"], int(r["step"])) for r in rows] == [("fused:data_dist", s) for s in range(4)] + [
        ("semi_sync", s) for s in range(4)
    ]
    assert all(float(r["max_abs_output_diff"]) == 0.0 for r in rows if r["pipeline"] == "fused:data_dist")
    semi = [float(r["max_abs_output_diff"]) for r in rows if r["pipeline"] == "semi_sync"]
    assert semi[0] == 0.0 and max(semi) > 0.0
    markdown = (tmp_path / "pipeline_diffs.md").read_text()
    assert "| fused:data_dist | plain | 4/4 |" in markdown and "| semi_sync | plain | 4/4 |" in markdown
    assert "Unsharded anchor" in markdown
    plots = sorted(p.name for p in tmp_path.glob("*.png"))
    assert plots == ["pipeline_drift_fused-data_dist_vs_plain.png", "pipeline_drift_semi_sync_vs_plain.png"]
    assert all((tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in plots)


@pytest.mark.world_size(1)
def test_report_is_written_even_when_parity_fails(rank_pool, tmp_path):
    from paritykit.harness import plants
    from paritykit.errors import ParityError

    spec = RunSpec(data=DataSpec(num_batches=3))
    with plants.applied(["skipped-zero-grad"]), pytest.raises(ParityError):
        pipeline_check.assert_pipeline_parity(rank_pool, spec, ("sparse_dist",), report_dir=tmp_path)
    rows = list(csv.DictReader((tmp_path / "pipeline_diffs.csv").open()))
    # Step 1 still sees a correct first update (grads start empty); the stale grads show from step 2.
    assert [float(r["max_abs_output_diff"]) > 0.0 for r in rows] == [False, False, True]


FIXED_IDS = ["dlrm/all-pipelines", "test-sparse-nn/all-pipelines", "dlrm/td-batches", "negative-control/feature-processor-under-fused"]
SURFACE_IDS = ["dlrm/pipeline-variants", "nested/postproc-and-tracing", "dlrm/eval-pipelines", "dlrm/gradient-accumulation",
               "dlrm/staged", "dlrm/lifecycle", "dlrm/backward-hooks", "dlrm/semi-sync-staleness",
               "dlrm-unused-lookup/semi-sync-staleness", "dense/pt2-compile-schedule"]


@pytest.mark.slow
def test_gate_run_passes_every_case_and_reports_the_negative_control(rank_pools, tmp_path):
    config = GateConfig(device="cpu", world_sizes=(1,), examples=2, seed=0, report_dir=tmp_path)
    every = matrix.run_matrix(config, rank_pools)
    # The backward-hook sites run in the caller (hook_sites.py: tests/test_pipeline_hook_sites.py).
    hooks = [r for r in every if r.case_id.startswith("backward hook")]
    assert hooks and {r.status for r in hooks} == {"pass"}
    results = [r for r in every if r not in hooks]
    ids = [r.case_id for r in results]
    assert ids[:4] == [f"ws1/{name}" for name in FIXED_IDS]
    # The surface cases at the largest world size (no known-broken case on one rank), then the draws.
    assert ids[4:4 + len(SURFACE_IDS)] == [f"ws1/{name}" for name in SURFACE_IDS]
    assert len(results) == 4 + len(SURFACE_IDS) + 2
    assert [r.status for r in results] == ["pass"] * len(results), [r.message for r in results if r.status != "pass"]
    assert results[3].metrics["flagged"].startswith("fused:data_dist vs plain")
    assert results[0].metrics["fused:new"]["max_output_diff"] == 0.0
    assert results[0].metrics["anchor"]["steps"] == 6
    assert results[0].metrics["semi_sync"]["max_output_diff"] > 0.0
    assert results[2].metrics["semi_sync[td]"]["reference"] == "semi_sync"
    assert len(list((tmp_path / "pipeline_ws1_dlrm_all-pipelines").glob("*.png"))) == len(ALL_PIPELINES)


class RecordingPoolProviderStub:
    """A stand-in for PoolProvider that records the world sizes asked for and starts no rank."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def get(self, world_size: int, backend=None):
        from paritykit.errors import HarnessError

        self.asked.append(world_size)
        raise HarnessError(f"stub: no pool of {world_size} ranks")


def test_every_world_size_the_config_asks_for_is_run_none_dropped_stub_pool_provider():
    pools = RecordingPoolProviderStub()
    config = GateConfig(device="cpu", world_sizes=(1, 5, 8), examples=3, seed=0, shrink=False)
    results = matrix.run_matrix(config, pools)
    assert set(pools.asked) == {1, 5, 8}
    fixed = results[: 3 * len(FIXED_IDS)]
    assert [r.case_id for r in fixed] == [f"ws{w}/{name}" for w in (1, 5, 8) for name in FIXED_IDS]
    surface = [r.case_id for r in results[3 * len(FIXED_IDS):] if r.case_id.startswith("ws8/") and "/seed" not in r.case_id]
    assert surface[: len(SURFACE_IDS)] == [f"ws8/{name}" for name in SURFACE_IDS]
    assert {"ws8/known-broken gradient-accumulation-flush-without-sync", "ws8/known-broken bwd-opt-steps-before-ddp-allreduce"} <= set(surface)
    # A pool that cannot start is the harness's error, never a pass or a parity failure; only the
    # backward-hook sites, which need no pool, pass.
    assert {r.status for r in results if not r.case_id.startswith("backward hook")} == {"error"}
    assert {r.status for r in results if r.case_id.startswith("backward hook")} == {"pass"}


def _check_matrix_case(pools, case: matrix.MatrixCase) -> None:
    result = pipeline_check.assert_pipeline_parity(pools.get(case.world_size), case.spec, (case.spec.pipeline, case.companion, "semi_sync"))
    assert [len(run.outputs) for run in result.runs.values()] == [case.spec.data.num_batches] * 4
    if case.spec.model.fused_optimizer == "adagrad":
        assert "element-wise Adagrad" in result.anchor["skipped"]
    else:
        assert result.anchor["steps"] == case.spec.data.num_batches


# Each example runs four pipelines on real ranks; three keep the default suite fast.
@settings(max_examples=3)
@given(case=matrix.pipeline_cases(world_sizes=(1, 2)))
def test_fused_and_sparse_dist_equal_the_plain_loop_and_semi_sync_stays_bounded(rank_pools, case):
    _check_matrix_case(rank_pools, case)


@pytest.mark.slow
@given(case=matrix.pipeline_cases(world_sizes=(1, 2)))
def test_fused_and_sparse_dist_equal_the_plain_loop_over_the_profiles_examples(rank_pools, case):
    _check_matrix_case(rank_pools, case)


@pytest.mark.slow
@settings(max_examples=4)
@given(case=matrix.pipeline_cases(world_sizes=(3, 4)))
def test_fused_and_sparse_dist_equal_the_plain_loop_on_three_and_four_ranks(rank_pools, case):
    _check_matrix_case(rank_pools, case)


def test_matrix_case_ids_name_every_dimension():
    case = matrix.MatrixCase(
        2, RunSpec(model=ModelSpec(sharding_types=("row_wise", "column_wise"), fused_optimizer="adagrad"), pipeline="fused:new")
    )
    assert matrix.case_id(case) == "ws2/dlrm/row_wise+column_wise/adagrad+sgd/b4x5/seed0,0/fused:new+sparse_dist/kjt/start0"
    assert "/fused:new+lite/" in matrix.case_id(replace(case, companion="lite"))
    assert matrix.case_id(replace(case, world_size=3)).startswith("ws3/")
