"""The pipeline check's gate entry: at every world size the config asks for, every pipeline on both
models with the unsharded anchor, TD batches against KJT batches, the feature-processor negative
control; then the drawn matrix."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from paritykit.checks.pipeline.assertion import ALL_PIPELINES, builtin_case
from paritykit.engine.builtin_models import DENSE_OPTIMIZERS, FUSED_OPTIMIZERS, SHARDING_TYPES, DataSpec, ModelSpec
from paritykit.checks.pipeline.hook_sites import PINNED as HOOK_SITES_PINNED, hook_site_cases, run_hook_site_case
from paritykit.checks.pipeline.parity import run_parity_case
from paritykit.checks.pipeline.surface import run_surface
from paritykit.engine.pipeline_catalog import EXACT, VARIANTS, available
from paritykit.engine.pipeline_runs import FUSED_PIPELINES, INPUT_TYPES, RunSpec
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property
from paritykit.dist import PoolProvider
from paritykit.errors import ParityError

NAME = "pipeline"
# SemiSync in the fixed DLRM case: batches 0..2 must be exact, drift may start at batch 3.
FIXED_SEMI_SYNC_START_BATCH = 2
# TD batches through each kind of pipeline (both fused lookup positions), each against its KJT run.
TD_PIPELINES = ("base", "sparse_dist", "fused:new", "fused:data_dist:after_dd", "semi_sync")
MAX_DRAWN_START_BATCH = 3


def feature_processor_control(pool: Any, spec: RunSpec, pipeline: str = "fused:data_dist") -> str:
    """Run the known-unsafe configuration; return the ParityError text that flags it.

    Raises ParityError if the fused pipeline with a position-weighted feature processor and the
    permitted lookup/optimizer overlap is *not* flagged as diverging (the check would be blind).
    """
    unsafe = replace(spec, model=replace(spec.model, feature_processor=True, kind="dlrm"), pipeline=pipeline, overlap_optimizer=True)
    case = builtin_case(unsafe, pool.world_size, (pipeline,), anchor=False)
    try:
        run_parity_case(case, pool)
    except ParityError as exc:
        return str(exc)
    raise ParityError(
        f"negative control not caught: {pipeline} with a feature processor and lookup/optimizer overlap "
        f"matched the plain loop exactly"
    )


@dataclass(frozen=True)
class MatrixCase:
    """One drawn example: the world size to run on, the run (its pipeline is the fused variant) and
    the non-fused exact pipeline next to it."""

    world_size: int
    spec: RunSpec
    companion: str = "sparse_dist"


# Exact variants only the surface cases run: SemiSync that never starts (the drawn cases run SemiSync
# already) and the threaded pipeline scripted (sparse_dist:jit is drawn).
SURFACE_ONLY = ("semi_sync:never_starts", "threaded:jit")


def companion_pipelines() -> tuple[str, ...]:
    """sparse_dist and the catalog's exact non-fused variants, drawn next to a fused one. Left out:
    those built with clear_data_dist_inputs, which on CPU frees an all-to-all's input still in
    flight where an EBC holds table-wise and column-wise tables (docs/pipeline.md), and SURFACE_ONLY."""
    return ("sparse_dist",) + tuple(
        name for name in available(EXACT)
        if not name.startswith("fused:") and "clear_data_dist_inputs" not in dict(VARIANTS[name].options)
        and name not in SURFACE_ONLY)


@st.composite
def pipeline_cases(draw: st.DrawFn, world_sizes: tuple[int, ...] = (1, 2)) -> MatrixCase:
    """A RunSpec over the matrix: world size, sharding types, optimizers, batch sizes, step counts
    (including fewer batches than the pipeline depth of 3), models, KJT or TD batches for the
    pipelines, SemiSync's start batch. The pipeline field is the fused variant to compare next to
    semi_sync and a companion (sparse_dist or one of the catalog's exact variants)."""
    model = ModelSpec(
        kind=draw(st.sampled_from(("dlrm", "test-sparse-nn"))),
        sharding_types=tuple(draw(st.lists(st.sampled_from(SHARDING_TYPES), min_size=1, max_size=3))),
        fused_optimizer=draw(st.sampled_from(FUSED_OPTIMIZERS)),
        dense_optimizer=draw(st.sampled_from(DENSE_OPTIMIZERS)),
        seed=draw(st.integers(0, 3)),
    )
    data = DataSpec(batch_size=draw(st.integers(1, 4)), num_batches=draw(st.integers(1, 6)), seed=draw(st.integers(0, 3)))
    world_size = draw(st.sampled_from(world_sizes))
    spec = RunSpec(
        model=model, data=data, pipeline=draw(st.sampled_from(FUSED_PIPELINES)), input_type=draw(st.sampled_from(INPUT_TYPES)),
        semi_sync_start_batch=draw(st.integers(0, MAX_DRAWN_START_BATCH)),
    )
    return MatrixCase(world_size, spec, draw(st.sampled_from(companion_pipelines())))


def case_id(case: MatrixCase) -> str:
    spec = case.spec
    m, d = spec.model, spec.data
    return (
        f"ws{case.world_size}/{m.kind}/{'+'.join(m.sharding_types)}/{m.fused_optimizer}+{m.dense_optimizer}"
        f"/b{d.batch_size}x{d.num_batches}/seed{m.seed},{d.seed}/{spec.pipeline}+{case.companion}/{spec.input_type}"
        f"/start{spec.semi_sync_start_batch}"
    )


def _fixed_specs(config: GateConfig) -> dict[str, tuple[RunSpec, tuple[str, ...], str]]:
    """case name -> (spec, pipelines, inputs) of the fixed cases at one world size."""
    dlrm = ModelSpec(num_tables=4, sharding_types=SHARDING_TYPES, fused_optimizer="rowwise_adagrad", seed=config.seed)
    data = DataSpec(num_batches=6, seed=config.seed)
    sparse_nn = ModelSpec(kind="test-sparse-nn", sharding_types=SHARDING_TYPES, dense_optimizer="adam", seed=config.seed)
    # Tables placed out of table order (t0, t2 TW; t1 RW), none duplicated by CW: the TD path's
    # feature order decides which table a feature reads.
    td_dlrm = ModelSpec(num_tables=3, sharding_types=("table_wise", "row_wise"), fused_optimizer="rowwise_adagrad", seed=config.seed)
    return {
        "dlrm/all-pipelines": (RunSpec(model=dlrm, data=data, semi_sync_start_batch=FIXED_SEMI_SYNC_START_BATCH), ALL_PIPELINES, "kjt"),
        "test-sparse-nn/all-pipelines": (RunSpec(model=sparse_nn, data=data), ALL_PIPELINES, "kjt"),
        "dlrm/td-batches": (RunSpec(model=td_dlrm, data=replace(data, num_batches=4), semi_sync_start_batch=1), TD_PIPELINES, "both"),
    }


def _fixed_cases(world_size: int, pools: PoolProvider, config: GateConfig) -> list[CaseResult]:
    """The fixed cases, then the feature-processor negative control, at one world size (a pool that
    cannot start is each case's harness error)."""
    results = []
    for name, (spec, pipelines, inputs) in _fixed_specs(config).items():
        spec = replace(spec, device=config.device)
        report_dir = None if config.report_dir is None else Path(config.report_dir) / f"pipeline_ws{world_size}_{name.replace('/', '_')}"
        case_name = f"ws{world_size}/{name}"

        def body(spec: RunSpec = spec, pipelines: tuple[str, ...] = pipelines, inputs: str = inputs, report_dir: Any = report_dir) -> dict:
            return run_parity_case(builtin_case(spec, world_size, pipelines, inputs=inputs), pools.get(world_size), report_dir).metrics()

        results.append(run_case(NAME, case_name, config, body))
    control_spec = RunSpec(data=DataSpec(num_batches=4, seed=config.seed), device=config.device)
    control = f"ws{world_size}/negative-control/feature-processor-under-fused"
    results.append(run_case(NAME, control, config,
                            lambda: {"flagged": feature_processor_control(pools.get(world_size), control_spec).splitlines()[0]}))
    return results


def run_matrix(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    """The fixed cases at every world size the config asks for, then the drawn matrix over them."""
    world_sizes = tuple(dict.fromkeys(config.world_sizes)) or (1,)
    results = []
    for world_size in world_sizes:
        results += _fixed_cases(world_size, pools, config)
    results += run_surface(pools, config)
    results += run_property(NAME, hook_site_cases(), run_hook_site_case, config, case_id=lambda case: case.case_id(),
                            explicit=HOOK_SITES_PINNED)

    def body(case: MatrixCase) -> dict[str, Any]:
        spec = replace(case.spec, device=config.device)
        pipelines = (spec.pipeline, case.companion, "semi_sync")
        return run_parity_case(builtin_case(spec, case.world_size, pipelines), pools.get(case.world_size)).metrics()

    results += run_property(NAME, pipeline_cases(world_sizes), body, config, case_id=case_id)
    return results

