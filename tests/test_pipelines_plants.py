"""The pipeline check's planted bugs that a plain-loop comparison alone cannot see. Each is first
shown to move torchrec's own numbers (the same torchrec run with and without the plant, compared
with torch.equal, no paritykit verdict involved), then shown to pass the old comparison (each
pipeline against a plain loop over the same DMP model and input), then caught by the check."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.pipeline.assertion import assert_pipeline_parity, builtin_case
from paritykit.checks.pipeline.comparison import DEFAULT_SEMI_SYNC_BOUNDS, predictions
from paritykit.engine.builtin_models import DataSpec, ModelSpec
from paritykit.checks.pipeline.parity import run_parity_case
from paritykit.engine.pipeline_runs import PipelineJob, RunSpec, run_pipeline, run_plain
from paritykit.checks.pipeline.verdicts import assert_identical
from paritykit.errors import ParityError
from paritykit.harness import plants

# Four tables cycling TW, RW, CW: the sparse EBC's sharding order of features is not table order.
MIXED = ModelSpec(num_tables=4, sharding_types=("table_wise", "row_wise", "column_wise"), fused_optimizer="rowwise_adagrad")
# Without column-wise tables no feature is duplicated, so a wrong feature order reads other tables
# instead of failing (with CW the TD path's KJT has fewer keys than the input dist splits: a crash).
TABLE_ROW_WISE = ModelSpec(num_tables=3, sharding_types=("table_wise", "row_wise"))


def _outputs_equal(a, b) -> list[bool]:
    return [all(torch.equal(x, y) for x, y in zip(step_a, step_b)) for step_a, step_b in zip(a.outputs, b.outputs)]


NEW_PLANTS = {"dmp-ddp-sums-dense-gradients", "semi-sync-starts-one-batch-early", "td-input-dist-ignores-feature-order"}


def test_the_new_plants_are_registered_for_the_pipeline_check():
    registered = {name for name, plant in plants.PLANTS.items() if plant.check == "pipeline"}
    assert NEW_PLANTS <= registered


@pytest.mark.world_size(2)
def test_dmp_summing_dense_gradients_moves_numbers_passes_the_plain_loop_comparison_and_fails_the_anchor(rank_pool):
    spec = RunSpec(model=MIXED, data=DataSpec(num_batches=4))
    setup = builtin_case(spec, 2, ("sparse_dist",)).setup
    clean = predictions(run_plain(rank_pool, setup))
    with plants.applied(["dmp-ddp-sums-dense-gradients"]):
        planted = predictions(run_plain(rank_pool, setup))
        # Shared by DMP's plain loop and every pipeline: the old comparison sees nothing.
        assert_pipeline_parity(rank_pool, spec, ("sparse_dist", "fused:new"), anchor=False)
        with pytest.raises(ParityError, match=r"(?s)unsharded anchor.*the plain loop over the DMP model.*differs"):
            assert_pipeline_parity(rank_pool, spec, ("sparse_dist", "fused:new"))
    # Step 0 trains from identical state; the doubled dense update shows from step 1 on.
    assert _outputs_equal(clean, planted) == [True, False, False, False]
    dense = [key for key in clean.state if key.startswith("over.")]
    assert dense and not any(torch.equal(clean.state[k], planted.state[k]) for k in dense)


@pytest.mark.world_size(2)
def test_semi_sync_starting_one_batch_early_moves_numbers_stays_in_the_drift_bound_and_fails_the_exact_prefix(rank_pool):
    spec = RunSpec(model=MIXED, data=DataSpec(num_batches=6), semi_sync_start_batch=2)
    setup = builtin_case(spec, 2, ("semi_sync",)).setup
    clean = run_pipeline(rank_pool, PipelineJob(setup, "semi_sync", semi_sync_start_batch=2))
    with plants.applied(["semi-sync-starts-one-batch-early"]):
        planted = run_pipeline(rank_pool, PipelineJob(setup, "semi_sync", semi_sync_start_batch=2))
        # start_batch=0, all the old check ran, cannot show it (index >= -1 is index >= 0).
        assert_pipeline_parity(rank_pool, RunSpec(model=MIXED, data=DataSpec(num_batches=6)), ("semi_sync",))
        with pytest.raises(ParityError, match=r"semi_sync vs plain: steps 0\.\.2 differ; with start_batch=2"):
            assert_pipeline_parity(rank_pool, spec, ("semi_sync",))
    assert _outputs_equal(clean, planted)[:3] == [True, True, False]
    # The old criterion, a drift bound, does not notice one step of extra lag.
    plain = predictions(run_plain(rank_pool, setup))
    drift = max(max((p - q).abs().max().item() for p, q in zip(a, b)) for a, b in zip(planted.outputs, plain.outputs))
    assert 0.0 < drift <= DEFAULT_SEMI_SYNC_BOUNDS.max_output_drift


@pytest.mark.world_size(2)
def test_td_input_dist_ignoring_feature_order_moves_numbers_passes_td_against_td_and_fails_td_against_kjt(rank_pool):
    spec = RunSpec(model=TABLE_ROW_WISE, data=DataSpec(num_batches=4))
    case = builtin_case(spec, 2, ("sparse_dist",), inputs="both")
    clean = predictions(run_plain(rank_pool, case.td_setup()))
    with plants.applied(["td-input-dist-ignores-feature-order"]):
        planted = predictions(run_plain(rank_pool, case.td_setup()))
        # The old comparison: a pipeline fed TDs against the plain loop fed the same TDs.
        td_pipeline = run_pipeline(rank_pool, PipelineJob(case.td_setup(), "sparse_dist"))
        assert_identical(planted, td_pipeline, ("plain[td]", "sparse_dist[td]"), "promised")
        with pytest.raises(ParityError, match=r"(?s)plain\[td\] vs plain: per-step values differ.*step 1, rank"):
            run_parity_case(case, rank_pool)
    # The first batch builds the input dist (and its feature order); from the second on the TD path is wrong.
    assert _outputs_equal(clean, planted) == [True, False, False, False]
