"""The pipeline check: a plain loop vs torchrec's train pipelines over the same model and data.

Oracle: TrainPipelineBase, TrainPipelineSparseDist and every TrainPipelineFusedSparseDist variant
promise the plain loop's numbers, so per-step predictions and losses, the final (gathered) tables,
dense parameters and both optimizers' states must be bit-identical. TrainPipelineSemiSync trades
exactness for speed: its per-step prediction drift and its normalized-entropy (NE) difference are
measured and must stay within ``SemiSyncBounds``.

Negative controls: a position-weighted feature processor under the fused pipeline, with the
lookup/optimizer overlap the GPU schedule permits (``stream_shim.overlap_optimizer_with_lookup``),
must be flagged; the planted bugs in ``paritykit.selftest.catalog_pipeline`` must be caught.
"""

from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import torch
from hypothesis import strategies as st

from paritykit.checks.base import GateConfig, PoolProvider, result_from_exception, run_property
from paritykit.compare import find_differences, format_differences
from paritykit.errors import HarnessError, ParityError
from paritykit.pipeline_models import DENSE_OPTIMIZERS, FUSED_OPTIMIZERS, SHARDING_TYPES, DataSpec, ModelSpec
from paritykit.pipelines import EXACT_PIPELINES, FUSED_PIPELINES, PIPELINES, PipelineRun, RunSpec, run_pipeline
from paritykit.report import CaseResult

NAME = "pipeline"
REFERENCE = "plain"
ALL_PIPELINES = tuple(name for name in PIPELINES if name != REFERENCE)


@dataclass(frozen=True)
class SemiSyncBounds:
    """How far TrainPipelineSemiSync may drift from the plain loop.

    Semi-sync computes batch i's embeddings before batch i-1's backward has updated the tables, so
    its predictions lag by one embedding update. The bounds are for the models of
    ``paritykit.pipeline_models`` at learning rates up to 0.1 over up to 16 steps; measured drift
    there stayed below 0.045 (drift) and 0.004 (NE difference) over both models, every fused and
    dense optimizer and world sizes 1 and 2 (16 steps of 4 examples).
    """

    max_output_drift: float = 0.1
    max_ne_difference: float = 0.02


DEFAULT_SEMI_SYNC_BOUNDS = SemiSyncBounds()


@dataclass
class PairComparison:
    """A candidate pipeline against the reference: per-step and final max-abs differences."""

    reference: str
    candidate: str
    reference_steps: int
    candidate_steps: int
    output_diff: list[float]
    loss_diff: list[float]
    final_diff: dict[str, float]
    ne_reference: float = math.nan
    ne_candidate: float = math.nan

    @property
    def max_output_diff(self) -> float:
        return max(self.output_diff, default=0.0)

    @property
    def ne_difference(self) -> float:
        return abs(self.ne_candidate - self.ne_reference)

    def metrics(self) -> dict[str, Any]:
        return {
            "steps": self.candidate_steps,
            "max_output_diff": self.max_output_diff,
            "max_loss_diff": max(self.loss_diff, default=0.0),
            **{f"final_{k}_diff": v for k, v in self.final_diff.items()},
            "ne_difference": self.ne_difference,
        }


@dataclass
class PipelineParityResult:
    """What ``assert_pipeline_parity`` ran and measured (the report is written from this)."""

    spec: RunSpec
    runs: dict[str, PipelineRun]
    comparisons: list[PairComparison] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        return {c.candidate: c.metrics() for c in self.comparisons}


# ---------------------------------------------------------------------------------------------
# Measuring


def normalized_entropy(run: PipelineRun) -> float:
    """Mean log loss over all steps and ranks divided by the entropy of the label rate (nan if undefined)."""
    if not run.losses:
        return math.nan
    losses = torch.stack(run.losses).double()
    labels = torch.stack(run.labels).double()
    rate = labels.mean().item()
    if rate <= 0.0 or rate >= 1.0:
        return math.nan
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return losses.mean().item() / entropy


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def _final_state(run: PipelineRun) -> dict[str, dict[str, torch.Tensor]]:
    return {"tables": run.tables, "dense": run.dense, "fused_state": run.fused_state, "dense_state": run.dense_state}


def compare_pair(reference: PipelineRun, candidate: PipelineRun) -> PairComparison:
    steps = min(reference.steps, candidate.steps)
    final_diff = {}
    for category, expected in _final_state(reference).items():
        actual = _final_state(candidate)[category]
        shared = [k for k in expected if k in actual and actual[k].shape == expected[k].shape]
        final_diff[category] = max((_max_abs(actual[k], expected[k]) for k in shared), default=0.0)
    return PairComparison(
        reference=reference.spec.pipeline,
        candidate=candidate.spec.pipeline,
        reference_steps=reference.steps,
        candidate_steps=candidate.steps,
        output_diff=[_max_abs(candidate.outputs[i], reference.outputs[i]) for i in range(steps)],
        loss_diff=[_max_abs(candidate.losses[i], reference.losses[i]) for i in range(steps)],
        final_diff=final_diff,
        ne_reference=normalized_entropy(reference),
        ne_candidate=normalized_entropy(candidate),
    )


# ---------------------------------------------------------------------------------------------
# Asserting


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
        ("final state", _final_state(candidate), _final_state(reference)),
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
            f"the bound {bounds.max_output_drift} (per-step drift: {_fmt_list(comparison.output_diff)})"
        )
    if not math.isnan(comparison.ne_difference) and comparison.ne_difference > bounds.max_ne_difference:
        raise ParityError(
            f"{semi_sync.spec.pipeline}: NE {comparison.ne_candidate:.6f} vs {comparison.ne_reference:.6f} "
            f"({reference.spec.pipeline}) differ by {comparison.ne_difference:.4g} > bound {bounds.max_ne_difference}"
        )
    return comparison


def _fmt_list(values: Iterable[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


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


# ---------------------------------------------------------------------------------------------
# Report files


def write_report(result: PipelineParityResult, directory: Path, prefix: str = "pipeline") -> list[Path]:
    """Per-step max-abs-diff table (CSV and Markdown) and one drift plot (PNG) per pipeline pair."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [_write_csv(result, directory / f"{prefix}_diffs.csv"), _write_markdown(result, directory / f"{prefix}_diffs.md")]
    for comparison in result.comparisons:
        written.append(_write_plot(comparison, directory / f"{prefix}_drift_{_file_safe(comparison.candidate)}_vs_{comparison.reference}.png"))
    return written


def _file_safe(name: str) -> str:
    return name.replace(":", "-")


def _rows(result: PipelineParityResult) -> list[list[Any]]:
    rows = []
    for c in result.comparisons:
        for step, (out, loss) in enumerate(zip(c.output_diff, c.loss_diff)):
            rows.append([c.candidate, c.reference, step, out, loss])
    return rows


def _write_csv(result: PipelineParityResult, path: Path) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["pipeline", "reference", "step", "max_abs_output_diff", "max_abs_loss_diff"])
        writer.writerows(_rows(result))
    return path


def _write_markdown(result: PipelineParityResult, path: Path) -> Path:
    lines = [f"# Pipeline parity: {result.spec.model.kind}, reference `{REFERENCE}`", ""]
    lines += ["| pipeline | steps | per-step max abs output diff | tables | dense | fused opt state | dense opt state | NE diff |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in result.comparisons:
        final = c.final_diff
        lines.append(
            f"| {c.candidate} | {c.candidate_steps}/{c.reference_steps} | {_fmt_list(c.output_diff)} | "
            f"{final['tables']:.3g} | {final['dense']:.3g} | {final['fused_state']:.3g} | {final['dense_state']:.3g} | "
            f"{c.ne_difference:.3g} |"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_plot(comparison: PairComparison, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5, 3))
    axes = figure.add_subplot()
    steps = list(range(len(comparison.output_diff)))
    axes.plot(steps, comparison.output_diff, marker="o", label="max |output diff|")
    axes.plot(steps, comparison.loss_diff, marker="x", label="max |loss diff|")
    axes.set_xlabel("step")
    axes.set_ylabel("max abs diff")
    axes.set_title(f"{comparison.candidate} vs {comparison.reference}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    return path


# ---------------------------------------------------------------------------------------------
# The gate


def feature_processor_control(pool: Any, spec: RunSpec, pipeline: str = "fused:data_dist") -> str:
    """Run the known-unsafe configuration; return the ParityError text that flags it.

    Raises ParityError if the fused pipeline with a position-weighted feature processor and the
    permitted lookup/optimizer overlap is *not* flagged as diverging (the check would be blind).
    """
    unsafe = replace(spec, model=replace(spec.model, feature_processor=True, kind="dlrm"), pipeline=pipeline, overlap_optimizer=True)
    reference = run_pipeline(pool, unsafe.with_pipeline(REFERENCE))
    fused = run_pipeline(pool, unsafe)
    try:
        assert_runs_identical(reference, fused)
    except ParityError as exc:
        return str(exc)
    raise ParityError(
        f"negative control not caught: {pipeline} with a feature processor and lookup/optimizer overlap "
        f"matched the plain loop exactly"
    )


@dataclass(frozen=True)
class MatrixCase:
    """One drawn example: the world size to run on and the run (its pipeline is the fused variant)."""

    world_size: int
    spec: RunSpec


@st.composite
def pipeline_cases(draw: st.DrawFn, world_sizes: tuple[int, ...] = (1, 2)) -> MatrixCase:
    """A RunSpec over the matrix: world size, sharding types, optimizers, batch sizes, step counts
    (including fewer batches than the pipeline depth of 3), models. The pipeline field is the fused
    variant to compare next to sparse_dist and semi_sync."""
    model = ModelSpec(
        kind=draw(st.sampled_from(("dlrm", "test-sparse-nn"))),
        sharding_types=tuple(draw(st.lists(st.sampled_from(SHARDING_TYPES), min_size=1, max_size=3))),
        fused_optimizer=draw(st.sampled_from(FUSED_OPTIMIZERS)),
        dense_optimizer=draw(st.sampled_from(DENSE_OPTIMIZERS)),
        seed=draw(st.integers(0, 3)),
    )
    data = DataSpec(batch_size=draw(st.integers(1, 4)), num_batches=draw(st.integers(0, 6)), seed=draw(st.integers(0, 3)))
    world_size = draw(st.sampled_from(world_sizes))
    return MatrixCase(world_size, RunSpec(model=model, data=data, pipeline=draw(st.sampled_from(FUSED_PIPELINES))))


def case_id(case: MatrixCase) -> str:
    spec = case.spec
    m, d = spec.model, spec.data
    return (
        f"ws{case.world_size}/{m.kind}/{'+'.join(m.sharding_types)}/{m.fused_optimizer}+{m.dense_optimizer}"
        f"/b{d.batch_size}x{d.num_batches}/seed{m.seed},{d.seed}/{spec.pipeline}"
    )


def _fixed_case(check_id: str, config: GateConfig, body: Any) -> CaseResult:
    started = time.perf_counter()
    replay = config.replay(NAME, check_id)
    try:
        metrics = body() or {}
    except Exception as exc:  # noqa: BLE001 - mapped to a status by result_from_exception
        return result_from_exception(NAME, check_id, replay, exc, started)
    return CaseResult(NAME, check_id, "pass", replay=replay, metrics=metrics, duration_s=time.perf_counter() - started)


def run(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    """Every pipeline on both models at each world size, the feature-processor control, then the matrix."""
    world_sizes = tuple(w for w in config.world_sizes if 1 <= w <= 4) or (1,)
    results = []
    for world_size in world_sizes:
        pool = pools.get(world_size)
        for kind in ("dlrm", "test-sparse-nn"):
            spec = RunSpec(
                model=ModelSpec(kind=kind, sharding_types=SHARDING_TYPES, fused_optimizer="rowwise_adagrad", seed=config.seed),
                data=DataSpec(num_batches=6, seed=config.seed),
                device=config.device,
            )
            report_dir = None if config.report_dir is None else Path(config.report_dir) / f"pipeline_ws{world_size}_{kind}"
            results.append(
                _fixed_case(
                    f"ws{world_size}/{kind}/all-pipelines",
                    config,
                    lambda pool=pool, spec=spec, report_dir=report_dir: assert_pipeline_parity(
                        pool, spec, report_dir=report_dir
                    ).metrics(),
                )
            )
        control_spec = RunSpec(data=DataSpec(num_batches=4, seed=config.seed), device=config.device)
        results.append(
            _fixed_case(
                f"ws{world_size}/negative-control/feature-processor-under-fused",
                config,
                lambda pool=pool, spec=control_spec: {"flagged": feature_processor_control(pool, spec).splitlines()[0]},
            )
        )

    def body(case: MatrixCase) -> dict[str, Any]:
        spec = replace(case.spec, device=config.device)
        pool = pools.get(case.world_size)
        return assert_pipeline_parity(pool, spec, (spec.pipeline, "sparse_dist", "semi_sync")).metrics()

    results += run_property(NAME, pipeline_cases(world_sizes), body, config, case_id=case_id)
    return results
