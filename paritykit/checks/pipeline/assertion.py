"""The pipeline check: a plain loop vs torchrec's train pipelines over the same model and data.

Oracle: TrainPipelineBase, TrainPipelineSparseDist and every TrainPipelineFusedSparseDist variant
promise the plain loop's numbers, so per-step predictions and losses, the final (gathered) tables,
dense parameters and both optimizers' states must be bit-identical. TrainPipelineSemiSync trades
exactness for speed: its per-step prediction drift and its normalized-entropy (NE) difference are
measured and must stay within ``SemiSyncBounds``.

Negative controls: a position-weighted feature processor under the fused pipeline, with the
lookup/optimizer overlap the GPU schedule permits (``stream_shim.overlap_optimizer_with_lookup``),
must be flagged; the planted bugs in plants.py must be caught.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import torch

from paritykit.checks.pipeline.comparison import (
    DEFAULT_SEMI_SYNC_BOUNDS,
    REFERENCE,
    PairComparison,
    PipelineParityResult,
    SemiSyncBounds,
    compare_pair,
    final_state,
    fmt_list,
)
from paritykit.checks.pipeline.report_files import write_report
from paritykit.checks.pipeline.runs import EXACT_PIPELINES, FUSED_PIPELINES, PIPELINES, PipelineRun, RunSpec, run_pipeline
from paritykit.compare import find_differences, format_differences
from paritykit.errors import HarnessError, ParityError

ALL_PIPELINES = tuple(name for name in PIPELINES if name != REFERENCE)


def assert_runs_identical(reference: PipelineRun, candidate: PipelineRun) -> None:
    """Bit-identical step count, per-step outputs and losses, and final state; else ParityError."""
    name, ref_name = candidate.spec.pipeline, reference.spec.pipeline
    if candidate.steps != reference.steps:
        raise ParityError(
            f"{name} ran {candidate.steps} steps but {ref_name} ran {reference.steps} over the same "
            f"{reference.spec.data.num_batches} batches per rank (a batch was dropped or repeated)"
        )
    per_step = {"outputs": candidate.outputs, "losses": candidate.losses}
    expected_steps = {"outputs": reference.outputs, "losses": reference.losses}
    for label, actual, expected in (
        ("per-step", per_step, expected_steps),
        ("final state", final_state(candidate), final_state(reference)),
    ):
        differences = find_differences(actual, expected, exact=True, name=name)
        if differences:
            raise ParityError(
                format_differences(
                    differences,
                    exact=True,
                    msg=f"{name} vs {ref_name}: {label} values differ (outputs[step][rank, example]); "
                    f"the pipeline promises the {ref_name} numbers exactly",
                )
            )


def assert_semi_sync_within(reference: PipelineRun, semi_sync: PipelineRun, bounds: SemiSyncBounds) -> PairComparison:
    """Semi-sync runs the same steps, drifts no more than ``bounds``; returns the measured drift."""
    if semi_sync.steps != reference.steps:
        raise ParityError(
            f"{semi_sync.spec.pipeline} ran {semi_sync.steps} steps but {reference.spec.pipeline} ran {reference.steps}"
        )
    comparison = compare_pair(reference, semi_sync)
    # The first batch is looked up before any update on both paths, so it must match exactly.
    if semi_sync.steps and not torch.equal(semi_sync.outputs[0], reference.outputs[0]):
        raise ParityError(
            f"{semi_sync.spec.pipeline}: step 0 predictions differ from {reference.spec.pipeline} by "
            f"{comparison.output_diff[0]:.4g}; nothing has been updated before step 0, so they must be identical"
        )
    if comparison.max_output_diff > bounds.max_output_drift:
        worst = max(range(len(comparison.output_diff)), key=comparison.output_diff.__getitem__)
        raise ParityError(
            f"{semi_sync.spec.pipeline}: prediction drift {comparison.max_output_diff:.4g} at step {worst} exceeds "
            f"the bound {bounds.max_output_drift} (per-step drift: {fmt_list(comparison.output_diff)})"
        )
    if not math.isnan(comparison.ne_difference) and comparison.ne_difference > bounds.max_ne_difference:
        raise ParityError(
            f"{semi_sync.spec.pipeline}: NE {comparison.ne_candidate:.6f} vs {comparison.ne_reference:.6f} "
            f"({reference.spec.pipeline}) differ by {comparison.ne_difference:.4g} > bound {bounds.max_ne_difference}"
        )
    return comparison


def unsafe_configuration(spec: RunSpec, pipeline: str) -> str:
    """Why ``pipeline`` is unsafe for ``spec``'s model, or "" when it is not known to be.

    TrainPipelineFusedSparseDist looks up the next batch's embeddings while the optimizer step of
    the current one runs; it relies on fused TBE having updated the tables in backward. A feature
    processor's parameters (e.g. position weights) are updated by the optimizer step instead, so on
    a GPU the overlapped lookup can read them before or after the update. On CPU everything runs in
    program order, so equal numbers prove nothing; torchrec's own docstring names this case. A
    lookup on the current stream ("fused:current*") is ordered after the optimizer and stays safe.
    """
    lookup_stream = PIPELINES[pipeline][1].get("emb_lookup_stream")
    if spec.model.feature_processor and pipeline in FUSED_PIPELINES and lookup_stream != "current":
        return (
            f"unsafe configuration: {pipeline} (TrainPipelineFusedSparseDist, emb_lookup_stream={lookup_stream!r}) "
            "with a feature processor: the next batch's lookup overlaps the optimizer step that updates the "
            "feature processor's parameters, so its numbers depend on stream timing on a GPU. Use "
            "emb_lookup_stream='current' or TrainPipelineSparseDist."
        )
    return ""


def assert_pipeline_parity(
    pool: Any,
    spec: RunSpec | None = None,
    pipelines: Iterable[str] = ALL_PIPELINES,
    *,
    semi_sync_bounds: SemiSyncBounds = DEFAULT_SEMI_SYNC_BOUNDS,
    report_dir: Path | str | None = None,
    allow_unsafe: bool = False,
) -> PipelineParityResult:
    """Run ``spec`` through the plain loop and each of ``pipelines`` on ``pool``; assert parity.

    Exact pipelines (base, sparse_dist, fused:*) must match the plain loop bit for bit;
    ``semi_sync`` must stay within ``semi_sync_bounds``. Raises ParityError at the first pipeline
    that breaks its promise, after writing the report if ``report_dir`` is given.

    A configuration known to be unsafe (see ``unsafe_configuration``) raises ParityError before
    anything runs, because equal numbers here would not mean it is safe on a GPU; pass
    ``allow_unsafe=True`` to measure it anyway.
    """
    spec = spec or RunSpec()
    names = list(dict.fromkeys(pipelines))
    unknown = [n for n in names if n not in ALL_PIPELINES]
    if unknown:
        raise HarnessError(f"unknown pipeline(s) {unknown}; choose from {', '.join(ALL_PIPELINES)}")
    unsafe = [n for n in names if unsafe_configuration(spec, n)]
    if unsafe and not allow_unsafe:
        raise ParityError(unsafe_configuration(spec, unsafe[0]))
    result = PipelineParityResult(spec=spec, runs={})
    reference = run_pipeline(pool, spec.with_pipeline(REFERENCE))
    result.runs[REFERENCE] = reference
    failure: ParityError | None = None
    for name in names:
        run = run_pipeline(pool, spec.with_pipeline(name))
        result.runs[name] = run
        result.comparisons.append(compare_pair(reference, run))
        if failure is not None:
            continue
        try:
            if name in EXACT_PIPELINES:
                assert_runs_identical(reference, run)
            else:
                assert_semi_sync_within(reference, run, semi_sync_bounds)
        except ParityError as exc:
            failure = exc
            if report_dir is None:
                raise
    if report_dir is not None:
        write_report(result, Path(report_dir))
    if failure is not None:
        raise failure
    return result
