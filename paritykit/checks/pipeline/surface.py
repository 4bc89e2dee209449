"""The pipeline check's surface cases: the rest of torchrec's pipeline machinery, each against an
independent oracle, pinned at the largest world size the gate asks for (where the sparse data dist
crosses ranks).

| case | what runs | oracle |
| --- | --- | --- |
| ``dlrm/pipeline-variants`` | every class and option of ``pipeline_catalog`` this torchrec has | the plain loop (exact; SemiSync bounds; all but the last two batches for ``execute_all_batches=False``), anchored to the unsharded model |
| ``nested/postproc-and-tracing`` | KJTs in a dict and a list, one behind a post-processing module | the same |
| ``dlrm/eval-pipelines`` | the eval pipelines, a flaky dataloader | the plain eval loop (exact), anchored to the unsharded eval forward; state untouched |
| ``dlrm/gradient-accumulation`` | GradientAccumulationWrapper, two epochs | the plain accumulating loop |
| ``dlrm/staged`` | StagedTrainPipeline + SparseDataDistUtil, flushed, two epochs, lookup ahead, detached and re-attached | the plain loop |
| ``dlrm/lifecycle`` | detach, attach, reset, a next epoch; the hybrid pipeline train/eval/train | the plain loop over the same sequence |
| ``dlrm/backward-hooks`` | register_backward_hook at every kind of site | each work once per step in backward; the plain loop |
| ``dlrm/semi-sync-staleness`` | TrainPipelineSemiSync from batch 1, six batches | the plain loop with one-step-stale lookups, exactly |
| ``dlrm-unused-lookup/semi-sync-staleness`` | the same on a model that looks the weighted tables up and ignores them (their embeddings get no gradient) | the same |
| ``dense/pt2-compile-schedule`` | TrainPipelinePT2 compiling a dense model (in the caller) at ``compile_on_iter`` | its hooks and dynamo's first graph at that step; the plain loop, exactly |

And, on two or more ranks, three known-broken cases (``known_issues.toml``): the same comparisons
where torchrec breaks them.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

from paritykit.checks.pipeline.comparison import DEFAULT_SEMI_SYNC_BOUNDS
from paritykit.checks.pipeline.parity import PipelineCase, run_parity_case
from paritykit.checks.pipeline.pt2_compile import CASE_ID as PT2_CASE_ID
from paritykit.checks.pipeline.pt2_compile import run_pt2_compile_case
from paritykit.checks.pipeline.surface_runs import (
    backward_hooks,
    backward_optimizer,
    eval_pipelines,
    gradient_accumulation,
    lifecycle,
    semi_sync_staleness,
    staged,
    stopped_eval_joined,
)
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_known_broken_case
from paritykit.dist import PoolProvider
from paritykit.engine.builtin_models import DataSpec, ModelSpec, batches_of, builtin_setup
from paritykit.engine.pipeline_catalog import EXACT, SEMI_SYNC, STOPS_WITH_DATA, available
from paritykit.engine.pipeline_staged import StagedDrive

NAME = "pipeline"
SURFACE_BATCHES = 6
SEMI_SYNC_START_BATCH = 1
NESTED_PIPELINES = ("sparse_dist", "sparse_dist:postproc", "fused:new", "fused:no_postproc", "semi_sync")
# Table-wise and row-wise tables (t0 TW, t1 RW, t2 TW, w0 RW): no EmbeddingBagCollection holds both
# table-wise and column-wise tables, whose input all-to-alls share one buffer, which
# clear_data_dist_inputs frees while the other is still in flight (docs/pipeline.md).
SURFACE_SHARDING_TYPES = ("table_wise", "row_wise")


def variant_pipelines() -> tuple[str, ...]:
    """The training variants this torchrec has (the post-processing ones run on the nested model)."""
    names = available(EXACT) + available(SEMI_SYNC) + available(STOPS_WITH_DATA)
    return tuple(name for name in names if not name.endswith("postproc"))


def dlrm_surface_setup(config: GateConfig, world_size: int) -> Any:
    spec = ModelSpec(num_tables=3, sharding_types=SURFACE_SHARDING_TYPES, fused_optimizer="rowwise_adagrad", seed=config.seed)
    return builtin_setup(spec, batches_of(spec, DataSpec(num_batches=SURFACE_BATCHES, seed=config.seed), world_size), config.device)


def unused_lookup_setup(config: GateConfig, world_size: int) -> Any:
    """The surface model, its weighted EBC looked up and left out of the prediction."""
    spec = ModelSpec(num_tables=3, sharding_types=SURFACE_SHARDING_TYPES, fused_optimizer="rowwise_adagrad", seed=config.seed,
                     unused_weighted=True)
    return builtin_setup(spec, batches_of(spec, DataSpec(num_batches=SURFACE_BATCHES, seed=config.seed), world_size), config.device)


def _nested_setup(config: GateConfig, world_size: int) -> Any:
    from paritykit.engine.nested_models import nested_setup

    return nested_setup(DataSpec(num_batches=SURFACE_BATCHES, seed=config.seed), world_size, device=config.device)


def _parity(setup: Any, pipelines: tuple[str, ...], label: str, pool: Any, report_dir: Path | None) -> dict[str, Any]:
    case = PipelineCase(setup, pipelines, label, semi_sync_start_batch=SEMI_SYNC_START_BATCH)
    return run_parity_case(case, pool, report_dir).metrics()


def surface_bodies(config: GateConfig, world_size: int) -> dict[str, Callable[[Any, Path | None], dict[str, Any]]]:
    """case name -> body(pool, report_dir)."""
    dlrm = functools.cache(lambda: dlrm_surface_setup(config, world_size))
    return {
        "dlrm/pipeline-variants": lambda pool, out: _parity(dlrm(), variant_pipelines(), "dlrm (pipeline variants)", pool, out),
        "nested/postproc-and-tracing": lambda pool, out: _parity(
            _nested_setup(config, world_size), NESTED_PIPELINES, "nested inputs and a post-processing module", pool, out),
        "dlrm/eval-pipelines": lambda pool, out: eval_pipelines(pool, dlrm()),
        "dlrm/gradient-accumulation": lambda pool, out: gradient_accumulation(pool, dlrm()),
        "dlrm/staged": lambda pool, out: staged(pool, dlrm(), DEFAULT_SEMI_SYNC_BOUNDS),
        "dlrm/lifecycle": lambda pool, out: lifecycle(pool, dlrm()),
        "dlrm/backward-hooks": lambda pool, out: backward_hooks(pool, dlrm()),
        "dlrm/semi-sync-staleness": lambda pool, out: semi_sync_staleness(pool, dlrm()),
        "dlrm-unused-lookup/semi-sync-staleness": lambda pool, out: semi_sync_staleness(
            pool, unused_lookup_setup(config, world_size), (1,)),
        PT2_CASE_ID: lambda pool, out: run_pt2_compile_case(config.seed),
    }


def known_broken_bodies(config: GateConfig, world_size: int) -> dict[str, Callable[[Any], dict[str, Any]]]:
    """Comparisons torchrec is known to fail on 2+ ranks (paritykit/checks/known_issues.toml)."""
    if world_size < 2:
        return {}
    dlrm = functools.cache(lambda: dlrm_surface_setup(config, world_size))
    return {
        # The last window ends inside an epoch and the wrapper learns of it from StopIteration.
        "known-broken gradient-accumulation-flush-without-sync": lambda pool: gradient_accumulation(
            pool, dlrm(), ("sparse_dist",), epochs=(3,), mark_last=False),
        "known-broken bwd-opt-steps-before-ddp-allreduce": lambda pool: backward_optimizer(pool, dlrm()),
        # A training loop that stops at the first None: the second epoch trains nothing.
        "known-broken staged-pipeline-next-epoch-returns-none": lambda pool: staged(
            pool, dlrm(), DEFAULT_SEMI_SYNC_BOUNDS, (("staged:two_epochs", StagedDrive(epochs=2, refill_between_epochs=False)),)),
        # EvalPipelineSparseDist stopped mid-epoch, then its thread joined.
        "known-broken data-loading-thread-join": lambda pool: stopped_eval_joined(pool, dlrm()),
    }


def run_surface(pools: PoolProvider, config: GateConfig) -> list[CaseResult]:
    """Every surface case at the largest world size of ``config``, then the known-broken ones."""
    world_size = max(config.world_sizes or (1,))
    results = []
    for name, body in surface_bodies(config, world_size).items():
        out = None if config.report_dir is None else Path(config.report_dir) / f"pipeline_ws{world_size}_{name.replace('/', '_')}"
        results.append(run_case(NAME, f"ws{world_size}/{name}", config,
                                lambda body=body, out=out: body(pools.get(world_size), out)))
    known_broken = known_broken_bodies(config, world_size)
    try:
        pool = pools.get(world_size) if known_broken else None
    except Exception:  # noqa: BLE001 - each case reports the pool's failure as its harness error
        pool = None
    for name, body in known_broken.items():
        results.append(run_known_broken_case(NAME, f"ws{world_size}/{name}", config, pool,
                                             lambda body=body: body(pools.get(world_size))))
    return results
