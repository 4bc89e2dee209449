"""The bodies of the pipeline check's surface cases: each runs torchrec's code and its oracle on the
ranks, compares, and returns what it compared (``surface.py`` names and schedules them).

- ``eval_pipelines``: every eval pipeline against the plain eval loop over the same sharded model
  (exactly) and its state untouched; that loop against the unsharded model's eval forward (the
  sharding engine's tolerance); a dataloader failing retriably (batch skipped) or not (error raised).
- ``gradient_accumulation``: the wrapper around pipelines against the plain accumulating loop (epochs
  run to their end, with warm-up steps, and one left inside a window and reset).
- ``staged``: StagedTrainPipeline with SparseDataDistUtil stages against the plain loop (exact; the
  semi-synchronous lookup-ahead variant exact at batch 0, then within the SemiSync bounds).
- ``lifecycle``: detach / a step outside / attach / reset / a new iterator, and the hybrid pipeline
  switching between training and evaluation, against the plain loop over the same sequence.
- ``semi_sync_staleness``: TrainPipelineSemiSync against the plain loop with its one-step-stale
  lookups (``pipeline_semisync.py``), exactly.
- ``backward_hooks``: work injected into backward runs once per step in order; numbers unchanged.
- the known-broken runs: the same comparisons where torchrec is known to break them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from paritykit.checks.pipeline.comparison import predictions
from paritykit.checks.pipeline.verdicts import assert_identical, assert_semi_sync, assert_untouched, assert_within
from paritykit.engine.pipeline_accumulation import PLAIN, AccumulationDrive
from paritykit.engine.pipeline_catalog import EVAL, available
from paritykit.engine.pipeline_eval import (
    PLAIN_EVAL,
    EvalDrive,
    StoppedEvalDrive,
    eval_reference,
    evaluated_steps,
    without_optimizer_state,
)
from paritykit.engine.pipeline_hooks import BackwardOptimizerDrive, HookedDrive
from paritykit.engine.pipeline_lifecycle import HybridDrive, LifecycleDrive, lifecycle_order
from paritykit.engine.pipeline_runs import PipelineJob, run_driven, run_pipeline, run_plain
from paritykit.engine.pipeline_semisync import StaleLookupDrive
from paritykit.engine.pipeline_staged import StagedDrive
from paritykit.engine.tolerances import default_tolerance, tolerance_for
from paritykit.engine.training import TrainingSetup
from paritykit.errors import HarnessError, NothingCompared

EXACT_EVAL = "an eval pipeline promises the model's eval forward of every batch, exactly as the plain eval loop"
ANCHOR = "the plain loop over the sharded model must match the unsharded model"
# Gradient accumulation: windows of two micro-batches; two epochs, the first ending inside a window.
ACCUMULATION_STEPS = 2
ACCUMULATION_EPOCHS = (3, 2)
# Then one epoch of all six batches with three warm-up steps: all-reduces at 0, 1, 2, 3, 5, none at 4.
ACCUMULATION_WARMUP = 3
# And two epochs of four and two batches, the first left after three (inside its second window) and reset.
ACCUMULATION_ABANDONED = ((4, 2), 3)
# The eval dataloader fails at this batch: retriably (skipped) or not (raised).
FAILING_BATCH = 1
# EvalPipelineSparseDist is reset after this many batches of the six (its thread must end).
EVAL_STOP_AFTER = 2
# Lifecycle: A is the first LIFECYCLE_FIRST batches, detached after LIFECYCLE_DETACH_AFTER steps.
LIFECYCLE_FIRST, LIFECYCLE_DETACH_AFTER = 3, 2
HYBRID_PHASES = (("train", 3), ("eval", 3), ("train", 3))  # longer than the two batches the pipeline fills at once
# Pipelines driven through gradient accumulation, the lifecycle and the backward hooks.
ACCUMULATED_PIPELINES = ("sparse_dist", "base")
LIFECYCLE_PIPELINES = ("sparse_dist", "fused:new", "semi_sync:never_starts", "base")
# pipeline -> (first, detach_after, side step). SemiSync looks the next batch up at the end of progress(),
# so a step taken while it is detached is not seen by that batch (docs/pipeline.md): it is detached and
# attached back to back, after one step, with three batches in flight (the one attach resumes is not the newest).
LIFECYCLE_SHAPES = {"semi_sync:never_starts": (4, 1, False)}
# SemiSync's staleness from batch 1 (exact through it, stale after), over the six surface batches:
# twice its queue of three.
STALENESS_START_BATCHES = (1,)


def eval_pipelines(pool: Any, setup: TrainingSetup) -> dict[str, Any]:
    """The eval pipelines against the plain eval loop, that loop against the unsharded model."""
    count = len(setup.batches)
    plain = run_driven(pool, setup, EvalDrive(PLAIN_EVAL), "plain:eval")
    assert_untouched(plain, setup.full_state, "plain:eval")
    reference = eval_reference(setup, list(range(count)))
    metrics = {"anchor": assert_within(reference, without_optimizer_state(plain), ("unsharded:eval", "plain:eval"),
                                       tolerance_for(setup), ANCHOR)}
    runs = [(name, EvalDrive(name)) for name in available(EVAL)]
    if "eval:sparse_dist" in available(EVAL):
        runs += [("eval:sparse_dist[retriable failure]", EvalDrive("eval:sparse_dist", FAILING_BATCH, True)),
                 ("eval:sparse_dist[failure]", EvalDrive("eval:sparse_dist", FAILING_BATCH + 1, False))]
    for name, drive in runs:
        expected = plain if drive.fail_at is None else run_driven(pool, setup, replace(drive, pipeline=PLAIN_EVAL), f"plain:eval[{name}]")
        if drive.fail_at is not None and len(expected.outputs) != len(evaluated_steps(count, drive)):
            raise HarnessError(f"paritykit's plain eval loop read {len(expected.outputs)} batches of the flaky dataloader, "
                               f"expected {len(evaluated_steps(count, drive))}")
        record = run_driven(pool, setup, drive, name)
        assert_untouched(record, setup.full_state, name)
        assert_identical(_prefix(expected, len(record.outputs), drive), record, ("plain:eval", name), EXACT_EVAL)
        metrics[name] = {"steps": len(record.outputs)}
    if "eval:sparse_dist" in available(EVAL):
        name = "eval:sparse_dist[reset mid-epoch]"
        record = run_driven(pool, setup, StoppedEvalDrive(EVAL_STOP_AFTER), name)
        assert_untouched(record, setup.full_state, name)
        expected = replace(plain, outputs=plain.outputs[:EVAL_STOP_AFTER], losses=plain.losses[:EVAL_STOP_AFTER],
                           embeddings=plain.embeddings[:EVAL_STOP_AFTER])
        assert_identical(expected, record, ("plain:eval", name), EXACT_EVAL)
        metrics[name] = {"steps": len(record.outputs)}
    return metrics


def _accumulation_abandoned(pool: Any, setup: TrainingSetup, tolerance: Any) -> dict[str, Any]:
    """An epoch left inside a window and the wrapper reset: the next epoch starts a clean window (the
    left window's gradients dropped, never stepped), as the plain loop that trains the same batches."""
    (epochs, after), name = ACCUMULATION_ABANDONED, f"sparse_dist[accumulating, epoch left after {ACCUMULATION_ABANDONED[1]}]"
    setup = replace(setup, batches=setup.batches[: sum(epochs)])
    plain = run_driven(pool, setup, AccumulationDrive(PLAIN, ACCUMULATION_STEPS, epochs, abandon_after=after), "plain[accumulating, epoch left]")
    record = run_driven(pool, setup, AccumulationDrive("sparse_dist", ACCUMULATION_STEPS, epochs, abandon_after=after), name)
    return {name: assert_within(plain, record, ("plain[accumulating, epoch left]", name), tolerance,
                                "reset() after an epoch left inside a window must start the next window clean")}


def stopped_eval_joined(pool: Any, setup: TrainingSetup) -> dict[str, Any]:
    """EvalPipelineSparseDist stopped mid-epoch by reset(), then its threads joined (known broken)."""
    if "eval:sparse_dist" not in available(EVAL):
        raise NothingCompared("this torchrec has no EvalPipelineSparseDist")
    name = "eval:sparse_dist[reset mid-epoch, joined]"
    record = run_driven(pool, setup, StoppedEvalDrive(EVAL_STOP_AFTER, join=True), name)
    return {name: {"steps": len(record.outputs)}}


def _prefix(expected: Any, steps: int, drive: EvalDrive) -> Any:
    """A failure that is not retriable ends evaluation early: the pipeline owes the steps before it."""
    if drive.fail_at is None or drive.retryable:
        return expected
    return replace(expected, outputs=expected.outputs[:steps], losses=expected.losses[:steps], embeddings=expected.embeddings[:steps])


def gradient_accumulation(pool: Any, setup: TrainingSetup, pipelines: tuple[str, ...] = ACCUMULATED_PIPELINES,
                          epochs: tuple[int, ...] = ACCUMULATION_EPOCHS, mark_last: bool = True) -> dict[str, Any]:
    """GradientAccumulationWrapper around each pipeline against the plain accumulating loop."""
    full, setup = setup, replace(setup, batches=setup.batches[: sum(epochs)])
    plain = run_driven(pool, setup, AccumulationDrive(PLAIN, ACCUMULATION_STEPS, epochs), "plain[accumulating]")
    metrics = {}
    # DDP all-reduces a window's gradients once instead of once per micro-batch: the same sum in
    # another order, so the sharding engine's norm-wise bound applies.
    tolerance = default_tolerance()
    for pipeline in pipelines:
        name = f"{pipeline}[accumulating]"
        record = run_driven(pool, setup, AccumulationDrive(pipeline, ACCUMULATION_STEPS, epochs, mark_last), name)
        metrics[name] = assert_within(plain, record, ("plain[accumulating]", name), tolerance,
                                      f"gradient accumulation over {ACCUMULATION_STEPS} steps must sum the window's gradients "
                                      "into one dense step")
    if mark_last:
        metrics.update(_accumulation_warmup(pool, full, tolerance))
        metrics.update(_accumulation_abandoned(pool, full, tolerance))
    return metrics


def _accumulation_warmup(pool: Any, setup: TrainingSetup, tolerance: Any) -> dict[str, Any]:
    """One epoch of every batch with warm-up steps: the all-reduce schedule (checked on the ranks:
    every step of the warm-up, then once per window) and the plain accumulating loop's numbers."""
    name = f"sparse_dist[accumulating, warm-up {ACCUMULATION_WARMUP}]"
    plain = run_driven(pool, setup, AccumulationDrive(PLAIN, ACCUMULATION_STEPS), "plain[accumulating, one epoch]")
    record = run_driven(pool, setup, AccumulationDrive("sparse_dist", ACCUMULATION_STEPS, warmup=ACCUMULATION_WARMUP), name)
    return {name: assert_within(plain, record, ("plain[accumulating, one epoch]", name), tolerance,
                                "warm-up steps change when DDP all-reduces, not what the window sums")}


STAGED_DRIVES = (("staged", StagedDrive()), ("staged:flush", StagedDrive(flush_after=2)),
                 ("staged:two_epochs", StagedDrive(epochs=2)), ("staged:lookup_ahead", StagedDrive(lookup_ahead=True)),
                 ("staged:detach_reattach", StagedDrive(detach_after=2)))


def staged(pool: Any, setup: TrainingSetup, semi_sync_bounds: Any, drives: tuple = STAGED_DRIVES) -> dict[str, Any]:
    plains: dict[int | None, Any] = {}
    metrics = {}
    for name, drive in drives:
        if drive.detach_after not in plains:
            plains[drive.detach_after] = run_driven(pool, setup, StagedDrive(plain=True, detach_after=drive.detach_after),
                                                    "plain[staged]")
        plain = plains[drive.detach_after]
        record = run_driven(pool, setup, drive, name)
        if drive.lookup_ahead:
            # The lookup of batch i+1 runs before batch i's backward: semi-synchronous from batch 1 on.
            metrics[name] = assert_semi_sync(plain, record, ("plain[staged]", name), semi_sync_bounds, 0).metrics()
        else:
            assert_identical(plain, record, ("plain[staged]", name), "the stages run ahead of the same training steps")
            metrics[name] = {"steps": len(record.outputs)}
    return metrics


def lifecycle(pool: Any, setup: TrainingSetup) -> dict[str, Any]:
    plains: dict[tuple[int, int, bool], Any] = {}
    metrics = {}
    for pipeline in LIFECYCLE_PIPELINES:
        shape = LIFECYCLE_SHAPES.get(pipeline, (LIFECYCLE_FIRST, LIFECYCLE_DETACH_AFTER, True))
        if shape not in plains:
            order = lifecycle_order(len(setup.batches), *shape)
            plains[shape] = predictions(run_plain(pool, replace(setup, batches=[setup.batches[i] for i in order]),
                                                  "plain[lifecycle]"))
        name = f"{pipeline}[lifecycle]"
        record = run_driven(pool, setup, LifecycleDrive(pipeline, *shape), name)
        assert_identical(plains[shape], record, ("plain[lifecycle]", name), "detach, attach and reset keep every step the plain loop's")
        metrics[name] = {"steps": len(record.outputs)}
    # The setup's batches again after its last where the phases need more (the plain loop sees the same).
    hybrid_setup = replace(setup, batches=[setup.batches[i % len(setup.batches)] for i in range(sum(c for _, c in HYBRID_PHASES))])
    hybrid_plain = run_driven(pool, hybrid_setup, HybridDrive(HYBRID_PHASES, PLAIN), "plain[train-eval-train]")
    record = run_driven(pool, hybrid_setup, HybridDrive(HYBRID_PHASES), "hybrid[train-eval-train]")
    assert_identical(hybrid_plain, record, ("plain[train-eval-train]", "hybrid[train-eval-train]"),
                     "the hybrid pipeline trains the training phases and only evaluates the eval phase")
    metrics["hybrid[train-eval-train]"] = {"steps": len(record.outputs)}
    return metrics


def semi_sync_staleness(pool: Any, setup: TrainingSetup, start_batches: tuple[int, ...] = STALENESS_START_BATCHES) -> dict[str, Any]:
    """TrainPipelineSemiSync against the plain loop with its documented one-step-stale lookups, exactly."""
    metrics = {}
    for start in start_batches:
        oracle = run_driven(pool, setup, StaleLookupDrive(start), f"plain[stale lookups from {start}]")
        name = f"semi_sync[start_batch={start}]"
        record = run_pipeline(pool, PipelineJob(setup, "semi_sync", start), name)
        assert_identical(oracle, record, (f"plain[stale lookups from {start}]", name),
                         "SemiSync looks each batch after start_batch up before the previous backward, and only that")
        metrics[name] = {"steps": len(record.outputs)}
    return metrics


def backward_hooks(pool: Any, setup: TrainingSetup, pipeline: str = "sparse_dist") -> dict[str, Any]:
    plain = predictions(run_plain(pool, setup))
    name = f"{pipeline}[backward hooks]"
    record = run_driven(pool, setup, HookedDrive(pipeline, tuple(setup.embedding_module_names)), name)
    assert_identical(plain, record, ("plain", name), "backward work must not change what the pipeline computes")
    return {name: {"steps": len(record.outputs)}}


def backward_optimizer(pool: Any, setup: TrainingSetup) -> dict[str, Any]:
    """TrainPipelineSparseDistBwdOpt against the plain loop (known to break on 2+ ranks)."""
    plain = predictions(run_plain(pool, setup))
    record = run_driven(pool, setup, BackwardOptimizerDrive(tuple(setup.embedding_module_names)), "bwd_opt")
    assert_identical(plain, record, ("plain", "bwd_opt"), "stepping the optimizer from backward must not change the step")
    return {"bwd_opt": {"steps": len(record.outputs)}}
