"""The pipeline check's verdicts, each a ParityError that names step, rank, module or key and element.

- ``assert_identical``: a pipeline that promises the plain loop's numbers (TrainPipelineBase,
  SparseDist, every FusedSparseDist variant), or a TD run against the same pipeline's KJT run, is
  bit-identical per step (embeddings by key, prediction, loss) and in its final state (tables
  gathered from the shards, dense parameters, fused and dense optimizer state).
- ``assert_semi_sync``: TrainPipelineSemiSync is bit-identical up to and including batch
  ``start_batch`` (every lookup until then follows the previous update), then drifts within
  ``SemiSyncBounds``.
- ``assert_anchor``: the plain loop over the DMP model matches the UNSHARDED model trained with
  torchrec's gradient semantics (the sharding engine's reference and its stated tolerance), so a bug
  that DMP shares with every pipeline cannot cancel out.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from paritykit.checks.pipeline.comparison import PairComparison, SemiSyncBounds, compare_pair, fmt_list
from paritykit.engine.comparison import (Tolerance, Where, compare_records, final_problems, first_divergence,
                                        per_step_problems, where_for)
from paritykit.engine.tolerances import tolerance_for
from paritykit.engine.training import TrainingRecord, TrainingSetup
from paritykit.compare import format_differences
from paritykit.errors import Divergence, ParityError

# Every compared number bit for bit.
EXACT_TOLERANCE = Tolerance()


def _steps_problem(reference: TrainingRecord, candidate: TrainingRecord, names: tuple[str, str]) -> str | None:
    if len(candidate.outputs) == len(reference.outputs):
        return None
    return (f"{names[1]} ran {len(candidate.outputs)} steps but {names[0]} ran {len(reference.outputs)} over the same "
            "batches (a batch was dropped or repeated)")


def _raise(problems: list[str], names: tuple[str, str], what: str, divergence: Divergence | None = None) -> None:
    shown = problems[:4] + ([f"... and {len(problems) - 4} more"] if len(problems) > 4 else [])
    raise ParityError(f"{names[1]} vs {names[0]}: {what}\n" + "\n".join(shown), divergence=divergence)


def path_of(names: tuple[str, str]) -> str:
    """The comparison a divergence is grouped by: a run on TensorDicts (against the same pipeline's KJT run,
    or the plain loop), or a pipeline against the plain loop."""
    return "TensorDict vs KJT" if names[1].endswith("[td]") else "pipeline vs plain loop"


def _located(candidate: TrainingRecord, reference: TrainingRecord, names: tuple[str, str], path: str,
             setup: TrainingSetup | None, tolerance: Tolerance = None) -> Divergence | None:
    where = where_for(setup, path) if setup is not None else Where(path)
    found = first_divergence(candidate, reference, tolerance or EXACT_TOLERANCE, where)
    return replace(found, detail=f"{names[1]} vs {names[0]}: {found.detail}") if found else None


def assert_identical(reference: TrainingRecord, candidate: TrainingRecord, names: tuple[str, str], promise: str,
                     setup: TrainingSetup | None = None) -> None:
    """Bit-identical step count, per-step embeddings, predictions and losses, and final state."""
    path = path_of(names)
    steps = _steps_problem(reference, candidate, names)
    if steps:
        raise ParityError(steps, divergence=Divergence("schedule", "step count", path, detail=steps))
    per_step = per_step_problems(candidate, reference, EXACT_TOLERANCE)
    if per_step:
        _raise(per_step, names, f"per-step values differ (step, rank, then what differs); {promise}",
               _located(candidate, reference, names, path, setup))
    final = final_problems(candidate, reference, EXACT_TOLERANCE)
    if final:
        _raise(final, names, f"final state differs; {promise}", _located(candidate, reference, names, path, setup))


def _prefix(record: TrainingRecord, steps: int) -> TrainingRecord:
    return replace(record, outputs=record.outputs[:steps], losses=record.losses[:steps], embeddings=record.embeddings[:steps],
                   state={}, fused_state={}, dense_state={})


def assert_semi_sync(
    reference: TrainingRecord, semi_sync: TrainingRecord, names: tuple[str, str], bounds: SemiSyncBounds,
    start_batch: int, labels: Any = None,
) -> PairComparison:
    """Exact through batch ``start_batch``, then within ``bounds``; returns the measured drift."""
    path = "semi-sync vs plain loop"
    steps = _steps_problem(reference, semi_sync, names)
    if steps:
        raise ParityError(steps, divergence=Divergence("schedule", "step count", path, detail=steps))
    exact_steps = min(start_batch + 1, len(reference.outputs))
    early = per_step_problems(_prefix(semi_sync, exact_steps), _prefix(reference, exact_steps), EXACT_TOLERANCE)
    if early:
        _raise(early, names, f"steps 0..{exact_steps - 1} differ; with start_batch={start_batch} every lookup up to batch "
                             f"{start_batch} follows the previous batch's update, so they must be identical",
               _located(_prefix(semi_sync, exact_steps), _prefix(reference, exact_steps), names, path, None))
    comparison = compare_pair(reference, semi_sync, names, labels)
    if comparison.max_output_diff > bounds.max_output_drift:
        worst = max(range(len(comparison.output_diff)), key=comparison.output_diff.__getitem__)
        message = (f"{names[1]}: prediction drift {comparison.max_output_diff:.4g} at step {worst} exceeds the bound "
                   f"{bounds.max_output_drift} (per-step drift from {names[0]}: {fmt_list(comparison.output_diff)})")
        raise ParityError(message, divergence=Divergence("forward", "prediction drift", path, worst, detail=message))
    if not math.isnan(comparison.ne_difference) and comparison.ne_difference > bounds.max_ne_difference:
        message = (f"{names[1]}: NE {comparison.ne_candidate:.6f} vs {comparison.ne_reference:.6f} ({names[0]}) differ by "
                   f"{comparison.ne_difference:.4g} > bound {bounds.max_ne_difference}")
        raise ParityError(message, divergence=Divergence("forward", "normalized entropy", path, detail=message))
    return comparison


def anchor_unsound(setup: TrainingSetup) -> str:
    """Why the sharding engine's norm-wise bound cannot hold the anchor of ``setup``, or "".

    The bound scales roundoff with each tensor's largest element. Element-wise Adagrad divides every
    table element's step by that element's own gradient history, so an element whose gradient is a
    near-cancellation (terms of 1e-3 summing to 1e-6, say) turns its relative roundoff of 1e-4 into a
    full-size step: measured in 6 of 36 drawn DMP-vs-unsharded runs with Adagrad tables and Adam
    dense layers, none of 180 with SGD or row-wise Adagrad tables (docs/pipeline.md).
    """
    if setup.embedding_optimizer.name == "adagrad":
        return ("element-wise Adagrad tables: a near-cancelling gradient element's roundoff becomes a full-size step, "
                "beyond the sharding engine's norm-wise bound")
    return ""


def assert_anchor(setup: TrainingSetup, plain: TrainingRecord, reference: TrainingRecord, header: str) -> dict[str, Any]:
    """The plain loop over DMP against the unsharded ``reference`` (the sharding engine's
    ``train_reference``: the unsharded model trained with torchrec's gradient semantics)."""
    tolerance = tolerance_for(setup)
    metrics = compare_records(plain, reference, tolerance, f"unsharded anchor, {header}: the plain loop over the DMP model",
                              where_for(setup))
    return {**metrics, "tolerance": tolerance.outputs.describe()}


def assert_within(reference: TrainingRecord, candidate: TrainingRecord, names: tuple[str, str], tolerance: Tolerance,
                  promise: str) -> dict[str, Any]:
    """Step count, per-step embeddings, predictions and losses, and final state within ``tolerance``."""
    steps = _steps_problem(reference, candidate, names)
    if steps:
        raise ParityError(steps)
    per_step = per_step_problems(candidate, reference, tolerance)
    if per_step:
        _raise(per_step, names, f"per-step values differ beyond {tolerance.outputs.describe()}; {promise}")
    final = final_problems(candidate, reference, tolerance)
    if final:
        _raise(final, names, f"final state differs; {promise}")
    return {"steps": len(reference.outputs), "tolerance": tolerance.outputs.describe()}


def assert_untouched(record: TrainingRecord, initial: dict[str, Any], name: str) -> None:
    """Evaluation trains nothing: the state after it equals the initial state bit for bit."""
    found = EXACT_TOLERANCE.state.differences(record.state, initial, "state")
    if found:
        raise ParityError(format_differences(found[:4], exact=True, msg=f"{name}: evaluation changed the model's state"))
