"""Negative controls of the pipeline check, and TrainPipelineSemiSync's measured drift."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paritykit.checks.pipeline.assertion import assert_pipeline_parity, builtin_case, unsafe_configuration
from paritykit.checks.pipeline.comparison import DEFAULT_SEMI_SYNC_BOUNDS, SemiSyncBounds, predictions
from paritykit.checks.pipeline.matrix import feature_processor_control
from paritykit.engine.builtin_models import DataSpec, ModelSpec
from paritykit.engine.pipeline_runs import PipelineJob, RunSpec, run_pipeline, run_plain
from paritykit.checks.pipeline.verdicts import assert_identical
from paritykit.errors import ParityError
from paritykit.harness import plants

FP_SPEC = RunSpec(model=ModelSpec(feature_processor=True, sharding_types=("table_wise", "row_wise")), data=DataSpec(num_batches=4))


def plain_and(pool, spec: RunSpec, pipeline: str, overlap: bool = False):
    """(plain loop, pipeline run) of ``spec`` on ``pool``, predictions only, and their names."""
    setup = builtin_case(spec, pool.world_size, (pipeline,)).setup
    plain = predictions(run_plain(pool, setup))
    return plain, run_pipeline(pool, PipelineJob(setup, pipeline, overlap_optimizer=overlap)), ("plain", pipeline)


@pytest.mark.world_size(2)
def test_feature_processor_under_fused_pipeline_is_flagged_as_diverging(rank_pool):
    message = feature_processor_control(rank_pool, FP_SPEC)
    assert "fused:data_dist vs plain" in message and "per-step values differ" in message


@pytest.mark.world_size(2)
def test_feature_processor_in_cpu_program_order_matches_so_only_the_overlap_exposes_it(rank_pool):
    # On CPU the optimizer always finishes before the next lookup: the hazard is invisible there.
    assert_identical(*plain_and(rank_pool, FP_SPEC, "fused:data_dist"), "promised")
    # With the lookup on the current stream the GPU orders it after the optimizer: no hazard either.
    assert_identical(*plain_and(rank_pool, FP_SPEC, "fused:current", overlap=True), "promised")


@pytest.mark.world_size(2)
def test_overlap_emulation_changes_nothing_for_a_model_without_feature_processor(rank_pool):
    spec = RunSpec(model=ModelSpec(fused_optimizer="adagrad", dense_optimizer="adam"), data=DataSpec(num_batches=4))
    for pipeline in ("fused:data_dist", "fused:new:after_dd"):
        assert_identical(*plain_and(rank_pool, spec, pipeline, overlap=True), "promised")


PLANT_CASES = [
    ("skipped-zero-grad", ModelSpec(), ("sparse_dist",), r"(?s)sparse_dist vs plain: per-step values differ"),
    ("stale-embedding-lookup", ModelSpec(), ("fused:data_dist",), r"(?s)fused:data_dist vs plain: per-step values differ"),
    ("lost-optimizer-state", ModelSpec(fused_optimizer="adagrad"), ("fused:current",), r"(?s)fused:current vs plain: per-step values differ"),
    ("dropped-last-batch", ModelSpec(), ("fused:data_dist:after_dd",), r"fused:data_dist:after_dd ran 3 steps but plain ran 4"),
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant, model, pipelines, message", PLANT_CASES, ids=[c[0] for c in PLANT_CASES])
def test_planted_pipeline_bug_is_caught(rank_pool, plant, model, pipelines, message):
    spec = RunSpec(model=model, data=DataSpec(num_batches=4))
    assert_pipeline_parity(rank_pool, spec, pipelines)  # clean run passes: the plant is what fails it
    with plants.applied([plant]):
        with pytest.raises(ParityError, match=message):
            assert_pipeline_parity(rank_pool, spec, pipelines)


@pytest.mark.world_size(2)
def test_stale_lookup_plant_also_pushes_semi_sync_past_its_step_zero_promise_or_bounds(rank_pool):
    spec = RunSpec(model=ModelSpec(fused_optimizer="adagrad"), data=DataSpec(num_batches=6))
    clean = assert_pipeline_parity(rank_pool, spec, ("semi_sync",)).comparisons[0]
    with plants.applied(["stale-embedding-lookup"]):
        planted = assert_pipeline_parity(rank_pool, spec, ("semi_sync",), semi_sync_bounds=SemiSyncBounds(1e9, 1e9)).comparisons[0]
    assert planted.max_output_diff > clean.max_output_diff


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["dlrm", "test-sparse-nn"])
def test_semi_sync_drift_is_nonzero_and_within_the_stated_bounds(rank_pool, kind):
    spec = RunSpec(
        model=ModelSpec(kind=kind, fused_optimizer="rowwise_adagrad", dense_optimizer="adam", sharding_types=("row_wise", "column_wise")),
        data=DataSpec(num_batches=8),
    )
    comparison = assert_pipeline_parity(rank_pool, spec, ("semi_sync",)).comparisons[0]
    assert comparison.output_diff[0] == 0.0  # nothing updated before step 0
    assert 0.0 < comparison.max_output_diff <= DEFAULT_SEMI_SYNC_BOUNDS.max_output_drift
    assert 0.0 < comparison.ne_difference <= DEFAULT_SEMI_SYNC_BOUNDS.max_ne_difference
    assert comparison.final_diff["state"] > 0.0


@pytest.mark.world_size(2)
def test_semi_sync_beyond_a_tight_bound_is_a_parity_error(rank_pool):
    spec = RunSpec(model=ModelSpec(fused_optimizer="adagrad"), data=DataSpec(num_batches=5))
    with pytest.raises(ParityError, match="semi_sync: prediction drift .* exceeds the bound 1e-09"):
        assert_pipeline_parity(rank_pool, spec, ("semi_sync",), semi_sync_bounds=SemiSyncBounds(max_output_drift=1e-9))


def test_plants_restore_torchrec_classes():
    from torchrec.distributed import model_parallel
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.train_pipeline import train_pipelines as tp

    before = {cls: cls.__dict__.get("progress") for cls in (tp.TrainPipelineBase, tp.TrainPipelineSparseDist, tp.TrainPipelineFusedSparseDist, tp.TrainPipelineSemiSync)}
    lookup = tp._start_embedding_lookup
    input_dist = ShardedEmbeddingBagCollection.__dict__["input_dist"]
    ddp_wrap = model_parallel.DefaultDataParallelWrapper.__dict__["_ddp_wrap"]
    names = [name for name, plant in plants.PLANTS.items() if plant.check == "pipeline"]
    assert {"skipped-zero-grad", "semi-sync-starts-one-batch-early", "attach-drops-in-flight-batches"} <= set(names)
    with plants.applied(names):
        assert tp.TrainPipelineFusedSparseDist.__dict__["progress"] is not before[tp.TrainPipelineFusedSparseDist]
        assert tp.TrainPipelineSemiSync.__dict__["progress"] is not before[tp.TrainPipelineSemiSync]
        assert tp._start_embedding_lookup is not lookup
        assert ShardedEmbeddingBagCollection.__dict__["input_dist"] is not input_dist
        assert model_parallel.DefaultDataParallelWrapper.__dict__["_ddp_wrap"] is not ddp_wrap
    assert {cls: cls.__dict__.get("progress") for cls in before} == before
    assert tp._start_embedding_lookup is lookup
    assert ShardedEmbeddingBagCollection.__dict__["input_dist"] is input_dist
    assert model_parallel.DefaultDataParallelWrapper.__dict__["_ddp_wrap"] is ddp_wrap


def test_unsafe_feature_processor_configuration_is_refused_before_anything_runs():
    # No pool is needed: the refusal comes from the configuration alone.
    with pytest.raises(ParityError, match=r"unsafe configuration: fused:new .* feature processor"):
        assert_pipeline_parity(None, FP_SPEC, ("sparse_dist", "fused:new"))
    assert unsafe_configuration(FP_SPEC, "fused:current") == ""
    assert unsafe_configuration(FP_SPEC, "sparse_dist") == ""
    assert unsafe_configuration(replace(FP_SPEC, model=ModelSpec()), "fused:data_dist") == ""


SEMI_SYNC_MODEL = ModelSpec(num_tables=3, sharding_types=("table_wise", "row_wise", "column_wise"), fused_optimizer="adagrad")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("start_batch", [1, 3])
def test_semi_sync_is_exact_through_start_batch_and_drifts_from_the_next_batch_on(rank_pool, start_batch):
    spec = RunSpec(model=SEMI_SYNC_MODEL, data=DataSpec(num_batches=7), semi_sync_start_batch=start_batch)
    drift = assert_pipeline_parity(rank_pool, spec, ("semi_sync",)).comparisons[0].output_diff
    assert drift[: start_batch + 1] == [0.0] * (start_batch + 1)
    # Measured on this data: batch start_batch + 1 is the first looked up before the previous
    # batch's backward, and it reads rows that backward updated.
    assert drift[start_batch + 1] > 0.0
    assert max(drift) <= DEFAULT_SEMI_SYNC_BOUNDS.max_output_drift


@pytest.mark.world_size(2)
def test_semi_sync_whose_start_batch_is_never_reached_trains_exactly_like_the_plain_loop(rank_pool):
    spec = RunSpec(model=SEMI_SYNC_MODEL, data=DataSpec(num_batches=4), semi_sync_start_batch=10)
    comparison = assert_pipeline_parity(rank_pool, spec, ("semi_sync",)).comparisons[0]
    assert comparison.output_diff == [0.0] * 4
    assert comparison.final_diff == {"state": 0.0, "fused_state": 0.0, "dense_state": 0.0}
