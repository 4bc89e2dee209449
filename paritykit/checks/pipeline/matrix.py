"""The pipeline check's gate entry: every pipeline on both models at each world size, the
feature-processor negative control, then the drawn matrix."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from paritykit.checks.pipeline.assertion import REFERENCE, assert_pipeline_parity, assert_runs_identical
from paritykit.checks.pipeline.models import DENSE_OPTIMIZERS, FUSED_OPTIMIZERS, SHARDING_TYPES, DataSpec, ModelSpec
from paritykit.checks.pipeline.runs import FUSED_PIPELINES, RunSpec, run_pipeline
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property
from paritykit.dist import PoolProvider
from paritykit.errors import ParityError

NAME = "pipeline"


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


def _fixed_case(case: str, config: GateConfig, body: Any) -> CaseResult:
    return run_case(NAME, case, config, body)


def _fixed_cases(world_size: int, pool: Any, config: GateConfig) -> list[CaseResult]:
    """Every pipeline on both models, then the feature-processor negative control, at one world size."""
    results = []
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
                lambda spec=spec, report_dir=report_dir: assert_pipeline_parity(pool, spec, report_dir=report_dir).metrics(),
            )
        )
    control_spec = RunSpec(data=DataSpec(num_batches=4, seed=config.seed), device=config.device)
    results.append(
        _fixed_case(
            f"ws{world_size}/negative-control/feature-processor-under-fused",
            config,
            lambda: {"flagged": feature_processor_control(pool, control_spec).splitlines()[0]},
        )
    )
    return results


def run_matrix(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    """Every pipeline on both models at each world size, the feature-processor control, then the matrix."""
    world_sizes = tuple(w for w in config.world_sizes if 1 <= w <= 4) or (1,)
    results = []
    for world_size in world_sizes:
        results += _fixed_cases(world_size, pools.get(world_size), config)

    def body(case: MatrixCase) -> dict[str, Any]:
        spec = replace(case.spec, device=config.device)
        pool = pools.get(case.world_size)
        return assert_pipeline_parity(pool, spec, (spec.pipeline, "sparse_dist", "semi_sync")).metrics()

    results += run_property(NAME, pipeline_cases(world_sizes), body, config, case_id=case_id)
    return results
