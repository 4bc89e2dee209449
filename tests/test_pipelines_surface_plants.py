"""The surface cases' planted bugs (paritykit/checks/pipeline/plants_surface.py). Each is first shown
to change what torchrec does (the same torchrec run with and without the plant: other numbers, or
another number of steps; for the backward hooks, the same numbers but work that never runs), then
caught by the comparison of the surface case aimed at it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from paritykit.checks.pipeline.comparison import predictions
from paritykit.checks.pipeline.surface import dlrm_surface_setup, surface_bodies
from paritykit.checks.pipeline.verdicts import assert_identical, assert_within
from paritykit.checks.runner import GateConfig
from paritykit.engine.builtin_models import DataSpec
from paritykit.engine.nested_models import nested_setup
from paritykit.engine.pipeline_accumulation import AccumulationDrive
from paritykit.engine.pipeline_eval import PLAIN_EVAL, EvalDrive, FlakyBatchError, FlakyBatches
from paritykit.engine.pipeline_hooks import HookedDrive
from paritykit.engine.pipeline_lifecycle import LifecycleDrive, lifecycle_order
from paritykit.engine.pipeline_runs import PipelineJob, run_driven, run_pipeline, run_plain
from paritykit.engine.pipeline_staged import StagedDrive
from paritykit.engine.tolerances import default_tolerance
from paritykit.errors import ParityError
from paritykit.harness import plants

CONFIG = GateConfig(world_sizes=(2,))
SURFACE_PLANTS = {
    "eval-skips-last-batch": "dlrm/eval-pipelines",
    "eval-pipeline-trains": "dlrm/eval-pipelines",
    "data-loading-errors-skipped": "dlrm/eval-pipelines",
    "gradient-accumulation-divides-twice": "dlrm/gradient-accumulation",
    "staged-drops-stage-output": "dlrm/staged",
    "inplace-copy-reuses-previous-batch": "dlrm/pipeline-variants",
    "postproc-result-from-previous-batch": "nested/postproc-and-tracing",
    "getitem-index-off-by-one": "nested/postproc-and-tracing",
    "attach-drops-in-flight-batches": "dlrm/lifecycle",
    "pipeline-new-iterator-stays-exhausted": "dlrm/lifecycle",
    "backward-work-off-the-graph": "dlrm/backward-hooks",
}


def _same(a, b) -> bool:
    return len(a.outputs) == len(b.outputs) and all(
        torch.equal(x, y) for sa, sb in zip(a.outputs, b.outputs) for x, y in zip(sa, sb))


@pytest.fixture(scope="module")
def dlrm():
    return dlrm_surface_setup(CONFIG, 2)


def test_the_surface_plants_are_registered_for_the_pipeline_check():
    registered = {name for name, plant in plants.PLANTS.items() if plant.check == "pipeline"}
    assert set(SURFACE_PLANTS) <= registered


def _lifecycle_plain(pool, setup):
    order = lifecycle_order(len(setup.batches), 3, 2)
    return predictions(run_plain(pool, replace(setup, batches=[setup.batches[i] for i in order])))


def _within(plain, planted):
    assert_within(plain, planted, ("plain", "planted"), default_tolerance(), "accumulated")


def _driven(drive):
    return lambda pool, setup: run_driven(pool, setup, drive, "oracle")


# plant -> (the torchrec run it changes, the oracle's run, the verdict that holds them together)
MOVES = {
    "eval-skips-last-batch": (EvalDrive("eval:fused"), _driven(EvalDrive(PLAIN_EVAL)), None),
    "eval-pipeline-trains": (EvalDrive("eval:sparse_dist"), _driven(EvalDrive(PLAIN_EVAL)), None),
    "gradient-accumulation-divides-twice": (AccumulationDrive("sparse_dist", 2), _driven(AccumulationDrive("plain", 2)), _within),
    "staged-drops-stage-output": (StagedDrive(), _driven(StagedDrive(plain=True)), None),
    "attach-drops-in-flight-batches": (LifecycleDrive("sparse_dist", 3, 2), _lifecycle_plain, None),
    "pipeline-new-iterator-stays-exhausted": (LifecycleDrive("sparse_dist", 3, 2), _lifecycle_plain, None),
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(MOVES))
def test_the_plant_changes_torchrecs_run_and_its_oracle_catches_it(rank_pool, dlrm, plant):
    drive, oracle, verdict = MOVES[plant]
    clean = run_driven(rank_pool, dlrm, drive, "clean")
    with plants.applied([plant]):
        planted = run_driven(rank_pool, dlrm, drive, "planted")
    assert not _same(clean, planted)
    expected = oracle(rank_pool, dlrm)
    check = verdict or (lambda plain, run: assert_identical(plain, run, ("plain", "planted"), "promised"))
    check(expected, clean)
    with pytest.raises(ParityError):
        check(expected, planted)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("pipeline, plant, nested", [
    ("sparse_dist:inplace_copy", "inplace-copy-reuses-previous-batch", False),
    ("sparse_dist:postproc", "postproc-result-from-previous-batch", True),
    ("sparse_dist", "getitem-index-off-by-one", True),
])
def test_the_plant_changes_the_pipelines_numbers_and_the_plain_loop_catches_it(rank_pool, dlrm, pipeline, plant, nested):
    setup = nested_setup(DataSpec(num_batches=4), 2) if nested else replace(dlrm, batches=dlrm.batches[:4])
    clean = run_pipeline(rank_pool, PipelineJob(setup, pipeline))
    with plants.applied([plant]):
        planted = run_pipeline(rank_pool, PipelineJob(setup, pipeline))
    assert not _same(clean, planted)
    plain = predictions(run_plain(rank_pool, setup))
    assert_identical(plain, clean, ("plain", pipeline), "exact")
    with pytest.raises(ParityError, match="per-step values differ"):
        assert_identical(plain, planted, ("plain", pipeline), "exact")


class _Batch(int):
    """A batch DataLoadingThread can move (it calls ``batch.to``)."""

    def to(self, device, non_blocking=False):
        return self


def _thread_reads(batches: list) -> list:
    """What torchrec's DataLoadingThread hands out of a dataloader that fails at batch 1 (not retriable)."""
    from torchrec.distributed.train_pipeline.utils import DataLoadingThread

    thread = DataLoadingThread(torch.device("cpu"), FlakyBatches(batches, 1, retryable=False), False)
    thread.start()
    got = []
    try:
        while (batch := thread.get_next_batch()) is not None:
            got.append(int(batch))
    except FlakyBatchError:
        got.append("error")
    finally:
        thread.stop()
    return got


def test_skipping_every_dataloader_error_hides_a_failed_dataloader():
    batches = [_Batch(i) for i in range(4)]
    assert _thread_reads(batches) == [0, "error"]
    with plants.applied(["data-loading-errors-skipped"]):
        assert _thread_reads(batches) == [0, 2, 3]


@pytest.mark.world_size(2)
def test_backward_work_off_the_graph_leaves_the_numbers_and_fails_the_hook_order(rank_pool, dlrm):
    setup = replace(dlrm, batches=dlrm.batches[:3])
    plain = predictions(run_plain(rank_pool, setup))
    with plants.applied(["backward-work-off-the-graph"]):
        # The numbers stay the plain loop's: only the order of work can show the plant.
        planted = run_pipeline(rank_pool, PipelineJob(setup, "sparse_dist"))
        assert_identical(plain, planted, ("plain", "sparse_dist"), "exact")
        with pytest.raises(ParityError, match=r"step 0 ran \['forward', 'param-grad over', 'optimizer step'\]"):
            run_driven(rank_pool, setup, HookedDrive("sparse_dist", tuple(setup.embedding_module_names)), "hooked")


@pytest.mark.slow
@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(SURFACE_PLANTS))
def test_the_surface_case_aimed_at_the_plant_catches_it(rank_pool, plant):
    body = surface_bodies(CONFIG, 2)[SURFACE_PLANTS[plant]]
    with plants.applied([plant]), pytest.raises(ParityError):
        body(rank_pool, None)
