"""The optim check's gate entry: torchrec's python optimizers and wrappers on dense parameters (in
the caller), then on a sharded model at every world size (the pinned cases at the largest), then
the combinations known to fail inside torchrec, each against its independent oracle."""

from __future__ import annotations

import dataclasses

from paritykit.checks.optim.case_runner import run_optim_case
from paritykit.checks.optim.contract_cases import ZERO_GRAD_WRAPPERS, ContractCase, SemiSyncCase, ZeroGradCase
from paritykit.checks.optim.dense_cases import KeyedCase, RowWiseCase, ScheduleCase
from paritykit.checks.optim.dense_runner import dense_case_id, is_dense_case, run_dense_case
from paritykit.checks.optim.draws import dense_cases, sharded_cases
from paritykit.checks.optim.fused_module_cases import FusedModuleCase, fused_module_cases, run_fused_module_case
from paritykit.checks.optim.fused_sharded_cases import FusedShardedCase, pinned_fused_sharded_cases, run_fused_sharded_case
from paritykit.checks.optim.known_broken import RULES, known_broken_cases, repair
from paritykit.checks.optim.pinned import WARMUP, pinned_cases
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_known_broken_case, run_property
from paritykit.dist import PoolProvider
from paritykit.engine.optim_wrapping import Warmup, WarmupStageSpec

NAME = "optim"
# A sharded case costs a second or two on two ranks, a dense one milliseconds: the gate draws one
# sharded case per this many examples (at least one per world size) and every dense example.
EXAMPLES_PER_SHARDED_CASE = 25
# A FusedEmbeddingBagCollection case trains 3 steps in the caller (tens of milliseconds).
EXAMPLES_PER_FUSED_MODULE_CASE = 5


def pinned_fused_module_cases() -> tuple[FusedModuleCase, ...]:
    """Each optimizer type a user hands FusedEmbeddingBagCollection, far from fbgemm's defaults; and one
    through fuse_embedding_optimizer (its configs' init bounds carried over)."""
    from paritykit.harness.configuration import RankBatch
    from paritykit.harness.tables import TableSpec

    tables = (TableSpec("t0", 6, 4, ("f0", "f1")), TableSpec("t1", 5, 8, ("f2",), "MEAN"))
    steps = tuple(RankBatch((("f0", ((1, 2), (3,))), ("f1", ((2,), ())), ("f2", ((0, 4, 4), (1,))))) for _ in range(3))
    # Configured init bounds on either side of zero and torchrec's default; a scheduler's learning rate.
    built = tuple(FusedModuleCase(name, hypers, tables, steps, seed=3, init_bounds=bounds, lr_factor=factor)
                  for name, hypers, bounds, factor in (
                      ("sgd", (("lr", 0.2),), ((2.0, 3.0), (-2.0, -1.5)), 0.5),
                      ("adagrad", (("lr", 0.5), ("eps", 1e-2)), (), 1.0),
                      ("rowwise_adagrad", (("lr", 0.5), ("eps", 1e-2)), (None, (0.5, 0.75)), 3.0)))
    # fuse_embedding_optimizer rewriting a model that holds the EBC one level down.
    return built + (FusedModuleCase("adagrad", (("lr", 0.5), ("eps", 1e-2)), tables, steps, seed=4, via="fuse_embedding_optimizer:nested",
                                   init_bounds=((0.5, 0.75), (2.0, 3.0))),)


def pinned_dense_cases() -> tuple:
    every_policy = Warmup((WarmupStageSpec("linear", 3, 0.1), WarmupStageSpec("poly", 6, 2.0), WarmupStageSpec("inv_sqrt", 8),
                           WarmupStageSpec("interpolate", 11, 0.5, start_interpolating_iters=8, end_value=0.1),
                           WarmupStageSpec("constant", 12, 0.3, lr_scale=2.0),
                           WarmupStageSpec("cosine_annealing_warm_restarts", 15, 0.1, sgdr_period=2)), 0.5)
    return (
        RowWiseCase((("eps", 1e-6), ("initial_accumulator_value", 0.3), ("lr", 0.1), ("lr_decay", 0.2), ("maximize", True),
                     ("weight_decay", 0.05)), resume_at=2),
        ScheduleCase(every_policy, 17, resume_at=5),
        ScheduleCase(WARMUP, 8),
        ScheduleCase(Warmup((WarmupStageSpec("step", 4, 0.5, decay_iters=2),), 0.2), 6),
        KeyedCase((0.5, 2.0), resume_at=2),
        SemiSyncCase(3, 0.7, "adam", resume_at=4),
        SemiSyncCase(2, 0.5, "sgd", resume_at=1, local_lr_factor=0.5),  # the lr change after the resume
        ContractCase(),
        # resumed from checkpoints storing the steps as float64 tensors and as numbers (step_forms.py)
        RowWiseCase((("eps", 1e-3), ("lr", 0.05), ("lr_decay", 0.1), ("weight_decay", 0.01)), resume_at=1, step_saved_as="float64"),
        RowWiseCase((("lr", 0.2),), steps=3, resume_at=2, step_saved_as="number"),
        ScheduleCase(WARMUP, 8, resume_at=3, in_combined=True),
        # zero_grad both ways and without the argument through every optimizer class (a known issue's combination repaired away)
        *dict.fromkeys(repair(ZeroGradCase(wrapper, set_to_none)) for wrapper in ZERO_GRAD_WRAPPERS for set_to_none in (True, False, None)),
        SemiSyncCase(2, 0.7, "sgd", resume_at=3, global_only=True),  # a parameter only the global optimizer holds
    )


def run_matrix(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    results = run_property(NAME, dense_cases(), run_dense_case, config, case_id=dense_case_id, explicit=pinned_dense_cases())
    results += run_property(NAME, fused_module_cases().map(repair), run_fused_module_case,
                            dataclasses.replace(config, examples=max(1, config.examples // EXAMPLES_PER_FUSED_MODULE_CASE)),
                            case_id=lambda case: case.case_id(), explicit=tuple(map(repair, pinned_fused_module_cases())))
    sharded_config = dataclasses.replace(config, examples=max(1, config.examples // EXAMPLES_PER_SHARDED_CASE))
    largest = max(config.world_sizes)
    for world_size in config.world_sizes:
        pool = pools.get(world_size)
        results += run_property(NAME, sharded_cases(world_size), lambda case, pool=pool: run_optim_case(case, pool),
                                sharded_config, case_id=lambda case: case.case_id(),
                                explicit=pinned_cases(world_size) if world_size == largest else ())
    pool = pools.get(largest)
    results += [run_case(NAME, case.case_id(), config, lambda case=case: run_fused_sharded_case(case, pool))
                for case in pinned_fused_sharded_cases(largest)]
    return results + _known_broken(config, pools)


def _known_broken(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    """Every rule once, on the smallest world size that shows it; outcomes reported as they are."""
    out = []
    for rule in RULES:
        sizes = [w for w in config.world_sizes if w >= rule.min_world_size]
        if not sizes:
            continue
        pool, case = pools.get(min(sizes)), known_broken_cases(min(sizes))[rule.name]
        if isinstance(case, FusedShardedCase):
            body, case_id = (lambda case=case, pool=pool: run_fused_sharded_case(case, pool)), case.case_id()
        elif is_dense_case(case):
            body, case_id = (lambda case=case: run_dense_case(case)), dense_case_id(case)
        else:
            body, case_id = (lambda case=case, pool=pool: run_optim_case(case, pool)), case.case_id()
        out.append(run_known_broken_case(NAME, f"known-broken {rule.name} {case_id}", config, pool, body))
    return out
