"""What a pipeline's options promise beyond its numbers (paritykit/engine/pipeline_promises.py), SemiSync
when it never starts, through detach/attach, and SemiSync's staleness (engine/pipeline_semisync.py):
each planted bug (paritykit/checks/pipeline/plants_options.py) is first shown to change what torchrec
does, then caught; the oracles are checked against the plain loop where they must equal it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from paritykit.checks.pipeline.comparison import DEFAULT_SEMI_SYNC_BOUNDS, predictions
from paritykit.checks.pipeline.surface import dlrm_surface_setup, surface_bodies
from paritykit.checks.pipeline.verdicts import assert_identical, assert_semi_sync
from paritykit.checks.runner import GateConfig
from paritykit.engine.builtin_models import DataSpec
from paritykit.engine.nested_models import nested_setup
from paritykit.engine.pipeline_accumulation import AccumulationDrive, expected_syncs
from paritykit.engine.pipeline_eval import PLAIN_EVAL, EvalDrive, StoppedEvalDrive
from paritykit.engine.pipeline_lifecycle import LifecycleDrive, lifecycle_order
from paritykit.engine.pipeline_promises import scriptable_dense_children
from paritykit.engine.pipeline_runs import PipelineJob, run_driven, run_pipeline, run_plain
from paritykit.engine.pipeline_semisync import StaleLookupDrive
from paritykit.errors import ParityError, RankFailure
from paritykit.harness import plants

CONFIG = GateConfig(world_sizes=(2,))
OPTION_PLANTS = {
    "lite-frees-callers-batch": "dlrm/pipeline-variants",
    "threaded-drops-apply-jit": "dlrm/pipeline-variants",
    "data-dist-inputs-never-cleared": "dlrm/pipeline-variants",
    "postproc-module-never-pipelined": "nested/postproc-and-tracing",
    "postproc-left-in-the-model": "nested/postproc-and-tracing",
    "semi-sync-skips-last-lookup": "dlrm/pipeline-variants",
    "attach-binds-last-context": "dlrm/lifecycle",
    "semi-sync-refills-when-empty": "dlrm/semi-sync-staleness",
    "data-loading-thread-ignores-stop": "dlrm/eval-pipelines",
    "gradient-accumulation-warmup-inverted": "dlrm/gradient-accumulation",
}


def _same(a, b) -> bool:
    return len(a.outputs) == len(b.outputs) and all(
        torch.equal(x, y) for sa, sb in zip(a.outputs, b.outputs) for x, y in zip(sa, sb))


@pytest.fixture(scope="module")
def dlrm():
    return dlrm_surface_setup(CONFIG, 2)


def test_the_option_plants_are_registered_for_the_pipeline_check():
    registered = {name for name, plant in plants.PLANTS.items() if plant.check == "pipeline"}
    assert set(OPTION_PLANTS) <= registered


def test_the_scripted_modules_expected_are_the_dense_children_beside_the_sharded_ones():
    from torchrec.distributed.types import ShardedModule

    class Sharded(ShardedModule):  # a stand-in: only its type matters to the walk
        def __init__(self):
            torch.nn.Module.__init__(self)

    Sharded.__abstractmethods__ = frozenset()

    model = torch.nn.Module()
    model.tower, model.top = torch.nn.Module(), torch.nn.Linear(2, 2)
    model.tower.ebc, model.tower.mlp = Sharded(), torch.nn.Linear(2, 2)
    assert set(scriptable_dense_children(model)) == {"tower.mlp", "top"}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("pipeline, plant, match", [
    ("lite", "lite-frees-callers-batch", "lost its data"),
    ("threaded:jit", "threaded-drops-apply-jit", "scripted none of the unsharded modules"),
    ("sparse_dist:free_inputs_early", "data-dist-inputs-never-cleared", "still hold their storage"),
])
def test_an_option_broken_keeps_the_numbers_and_fails_its_promise(rank_pool, dlrm, pipeline, plant, match):
    setup = replace(dlrm, batches=dlrm.batches[:3])
    plain = predictions(run_plain(rank_pool, setup))
    assert_identical(plain, run_pipeline(rank_pool, PipelineJob(setup, pipeline)), ("plain", pipeline), "exact")
    with plants.applied([plant]), pytest.raises(ParityError, match=match):
        run_pipeline(rank_pool, PipelineJob(setup, pipeline))


@pytest.mark.world_size(2)
def test_a_postproc_module_left_in_the_forward_is_caught_by_the_pipelined_modules(rank_pool):
    setup = nested_setup(DataSpec(num_batches=3), 2)
    run_pipeline(rank_pool, PipelineJob(setup, "sparse_dist:postproc"))
    run_pipeline(rank_pool, PipelineJob(setup, "sparse_dist"))  # item_ebc unpipelined, as declared
    with plants.applied(["postproc-module-never-pipelined"]), pytest.raises(ParityError, match=r"expected \['fold', 'item_ebc'"):
        run_pipeline(rank_pool, PipelineJob(setup, "sparse_dist:postproc"))


@pytest.mark.world_size(2)
def test_a_postproc_module_never_swapped_into_the_model_is_caught_by_the_pipelined_modules(rank_pool):
    setup = nested_setup(DataSpec(num_batches=3), 2)
    with plants.applied(["postproc-left-in-the-model"]):
        with pytest.raises(ParityError, match=r"pipelined modules \['item_ebc', 'scored_ebc', 'user_ebc'\], expected \['fold'"):
            run_pipeline(rank_pool, PipelineJob(setup, "sparse_dist:postproc"))


@pytest.mark.world_size(2)
def test_semi_sync_that_never_starts_is_the_plain_loop_and_a_skipped_last_lookup_breaks_it(rank_pool, dlrm):
    setup = replace(dlrm, batches=dlrm.batches[:4])
    plain = predictions(run_plain(rank_pool, setup))
    assert_identical(plain, run_pipeline(rank_pool, PipelineJob(setup, "semi_sync:never_starts")), ("plain", "semi"), "exact")
    with plants.applied(["semi-sync-skips-last-lookup"]), pytest.raises((ParityError, RankFailure)):
        run_pipeline(rank_pool, PipelineJob(setup, "semi_sync:never_starts"))


@pytest.mark.world_size(2)
def test_attach_bound_to_the_newest_context_breaks_semi_sync_resumed(rank_pool, dlrm):
    drive = LifecycleDrive("semi_sync:never_starts", 4, 1, side_step=False)
    order = lifecycle_order(len(dlrm.batches), 4, 1, side_step=False)
    plain = predictions(run_plain(rank_pool, replace(dlrm, batches=[dlrm.batches[i] for i in order])))
    assert_identical(plain, run_driven(rank_pool, dlrm, drive, "clean"), ("plain", "clean"), "exact")
    with plants.applied(["attach-binds-last-context"]), pytest.raises((ParityError, RankFailure)):
        assert_identical(plain, run_driven(rank_pool, dlrm, drive, "planted"), ("plain", "planted"), "exact")


@pytest.mark.world_size(2)
def test_the_stale_lookup_oracle_is_the_plain_loop_before_its_start_and_stale_after(rank_pool, dlrm):
    setup = replace(dlrm, batches=dlrm.batches[:4])
    plain = predictions(run_plain(rank_pool, setup))
    assert_identical(plain, run_driven(rank_pool, setup, StaleLookupDrive(len(setup.batches)), "never"), ("plain", "never"), "exact")
    stale = run_driven(rank_pool, setup, StaleLookupDrive(1), "stale")
    assert [torch.equal(a, b) for s, t in zip(plain.outputs, stale.outputs) for a, b in zip(s, t)][:4] == [True] * 4
    assert not _same(plain, stale)  # batch 2 on is looked up before batch 1's update


@pytest.mark.world_size(2)
def test_semi_sync_refilling_only_when_empty_stays_in_the_drift_bounds_and_fails_the_staleness(rank_pool, dlrm):
    clean = run_pipeline(rank_pool, PipelineJob(dlrm, "semi_sync", 0))
    with plants.applied(["semi-sync-refills-when-empty"]):
        planted = run_pipeline(rank_pool, PipelineJob(dlrm, "semi_sync", 0))
    assert not _same(clean, planted)
    oracle = run_driven(rank_pool, dlrm, StaleLookupDrive(0), "stale")
    plain = predictions(run_plain(rank_pool, dlrm))
    assert_semi_sync(plain, planted, ("plain", "planted"), DEFAULT_SEMI_SYNC_BOUNDS, 0, None)  # the old comparison misses it
    assert_identical(oracle, clean, ("stale", "clean"), "exact")
    with pytest.raises(ParityError, match="per-step values differ"):
        assert_identical(oracle, planted, ("stale", "planted"), "exact")


@pytest.mark.world_size(2)
def test_a_data_loading_thread_that_ignores_stop_is_caught_after_reset(rank_pool, dlrm):
    setup = replace(dlrm, batches=dlrm.batches[:5])  # more than the 2 + 2 it may read: one left to read on
    plain = run_driven(rank_pool, setup, EvalDrive(PLAIN_EVAL), "plain:eval")
    stopped = run_driven(rank_pool, setup, StoppedEvalDrive(2, timeout_s=2.0), "stopped")
    assert [[torch.equal(a, b) for a, b in zip(s, t)] for s, t in zip(plain.outputs[:2], stopped.outputs)] == [[True, True]] * 2
    with plants.applied(["data-loading-thread-ignores-stop"]), pytest.raises(ParityError, match="left .*DataLoadingThread.* running"):
        run_driven(rank_pool, setup, StoppedEvalDrive(2, timeout_s=2.0), "planted")


def test_the_all_reduce_schedule_of_gradient_accumulation_by_hand():
    # windows of 2, 3 warm-up steps, 6 batches: warm-up 0-2, window ends 1, 3, 5; the last batch marked.
    assert expected_syncs(6, 2, 3, True) == [True, True, True, True, False, True]
    assert expected_syncs(5, 3, 1, False) == [True, False, True, False, False]


@pytest.mark.world_size(2)
def test_an_inverted_warm_up_moves_the_all_reduces_and_is_caught(rank_pool, dlrm):
    drive = AccumulationDrive("sparse_dist", 2, warmup=3)
    clean = run_driven(rank_pool, dlrm, drive, "clean")
    with plants.applied(["gradient-accumulation-warmup-inverted"]), \
            pytest.raises(ParityError, match=r"all-reduced at steps \[0, 1, 3, 4, 5\], expected \[0, 1, 2, 3, 5\]"):
        run_driven(rank_pool, dlrm, drive, "planted")
    assert len(clean.outputs) == len(dlrm.batches)


@pytest.mark.slow
@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(OPTION_PLANTS))
def test_the_surface_case_aimed_at_the_plant_catches_it(rank_pool, plant):
    body = surface_bodies(CONFIG, 2)[OPTION_PLANTS[plant]]
    with plants.applied([plant]), pytest.raises((ParityError, RankFailure)):
        body(rank_pool, None)
