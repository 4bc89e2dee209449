"""Combinations of torchrec's optimizer wrappers that fail inside torchrec: kept out of the draws
while their known-issues entry applies, and run on purpose as ``known-broken <rule>`` cases.

- ``warmup-resume-through-combined-optimizer``: ``WarmupOptimizer`` keeps its iteration in the
  state mapping it was handed at construction; over a ``CombinedOptimizer`` (and any wrapper of
  one: DMP's fused optimizer, a ``GradientClippingOptimizer`` of it) that mapping is a copy built
  by a property, so ``state_dict()`` never carries the iteration and after ``load_state_dict`` the
  schedule starts again at iteration 0.
- ``resume-with-dense-table-missing-on-a-rank``: a dense-kernel table without a shard on some rank
  leaves that rank an empty placeholder parameter; training never gives it a gradient (so no
  optimizer state), ``init_state()`` does, and ``load_state_dict`` of the trained state then fails
  ("Different parameter count").
- ``update-hyper-parameters-lr-lost``: ``update_hyper_parameters({"lr": ...})`` through the wrappers
  reaches fbgemm's TBE, but a fused optimizer's ``zero_grad()`` and ``step()`` hand the TBE its
  param groups' lr again (which the call left alone): the new lr never trains anything.
- ``semi-sync-local-param-groups-not-restored``: ``SemisyncOptimizer`` with ``save_param_groups(True)``
  saves the local and the global optimizer's param groups, but ``KeyedOptimizer.load_state_dict``
  matches groups by their parameters' keys, which the two share: only the global group is loaded,
  and a changed local lr silently returns to its initial value.
- ``warmup-inv-sqrt-first-stage``: a ``WarmupOptimizer`` whose first stage is ``INVSQRT`` computes
  1 / sqrt(0) for iteration 0 when it is built (ZeroDivisionError).
- ``keyed-optimizer-wrapper-zero-grad-ignores-set-to-none``: ``KeyedOptimizerWrapper.zero_grad(set_to_none=False)``
  calls the wrapped optimizer's ``zero_grad()`` without the argument: gradients become None.
- ``fused-module-sgd-optimizer-lists-no-tables``: a ``FusedEmbeddingBagCollection`` trained with SGD has a
  fused optimizer that holds no table: fbgemm keeps no SGD state (``split_optimizer_states()`` is ``[]``)
  and torchrec's ``EmbeddingFusedOptimizer`` zips the tables with it, so its params, state and param
  groups name none (they name each table under the stateful optimizers, and the sharded module's fused
  SGD optimizer does). The drawn SGD cases train without the param-group check.
- ``fused-ebc-plan-generators-give-dense-kernel``: torchrec's plan generators (``table_wise(rank=...)``,
  ``construct_module_sharding_plan``) without a ``compute_kernel`` give a FusedEmbeddingBagCollection's
  tables the dense kernel (they choose fused only for parameters carrying an in-backward optimizer),
  which its sharder does not offer; DMP shards it so anyway and its tables never train. The pinned
  sharded fused cases name the fused kernel.
- ``fused-ebc-data-parallel-cpu-ddp-device-ids``: a FusedEmbeddingBagCollection's data-parallel table on a
  CPU: the sharded module wraps its lookup in DDP with ``device_ids=[cpu]``, which DDP refuses. The
  pinned sharded fused cases place no table data-parallel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from paritykit.checks import known_issues
from paritykit.checks.optim.cases import OptimCase
from paritykit.checks.optim.contract_cases import SemiSyncCase, ZeroGradCase
from paritykit.checks.optim.dense_cases import ScheduleCase
from paritykit.checks.optim.fused_module_cases import FusedModuleCase
from paritykit.checks.optim.fused_sharded_cases import FusedShardedCase, pinned_fused_sharded_cases
from paritykit.checks.optim.pinned import WARMUP, pinned_cases
from paritykit.engine.optim_wrapping import HyperParameterChange, Warmup, WarmupStageSpec
from paritykit.harness.configuration import RankBatch
from paritykit.harness.tables import TableSpec


@dataclass(frozen=True)
class BrokenCombination:
    name: str
    applies: Callable[[Any], bool]
    repair: Callable[[Any], Any]
    min_world_size: int = 1

    def kept_out(self) -> str | None:
        return known_issues.rule_kept_out(self.name)


def _warmup_resume(case: Any) -> bool:
    return isinstance(case, OptimCase) and case.wrapping.warmup is not None and case.wrapping.resume_at is not None


def tables_missing_on_a_rank(case: OptimCase) -> tuple[str, ...]:
    """Dense-kernel model-parallel tables that some rank holds no shard of."""
    missing = []
    for table in case.model_parallel_dense_tables():
        entry = case.plan[table]
        ranks = {entry[1]} if entry[0] == "table_wise" else set(entry[1]) if entry[0] == "column_wise" else set(range(case.world_size))
        if len(ranks) < case.world_size:
            missing.append(table)
    return tuple(missing)


def _missing_on_a_rank(case: Any) -> bool:
    return isinstance(case, OptimCase) and case.wrapping.resume_at is not None and bool(tables_missing_on_a_rank(case))


def _without_resume(case: OptimCase) -> OptimCase:
    return dataclasses.replace(case, wrapping=dataclasses.replace(case.wrapping, resume_at=None))


def _fused_where_missing(case: OptimCase) -> OptimCase:
    return dataclasses.replace(case, kernels={**case.kernels, **{t: "fused" for t in tables_missing_on_a_rank(case)}})


def _lr_through_update_hyper_parameters(case: Any) -> bool:
    return isinstance(case, OptimCase) and any(dict(c.values).get("lr") is not None for c in case.wrapping.hyper_parameter_changes)


def _without_lr_update(case: OptimCase) -> OptimCase:
    changes = tuple(dataclasses.replace(c, values=tuple((k, v) for k, v in c.values if k != "lr"))
                    for c in case.wrapping.hyper_parameter_changes)
    return dataclasses.replace(case, wrapping=dataclasses.replace(case.wrapping, hyper_parameter_changes=changes))


def _semi_sync_local_lr_saved(case: Any) -> bool:
    return (isinstance(case, SemiSyncCase) and case.resume_at is not None and case.resume_at > 1
            and case.local_lr_factor != 1.0)


def _inv_sqrt_first(case: Any) -> bool:
    return isinstance(case, ScheduleCase) and case.warmup.stages[0].policy == "inv_sqrt"


def _linear_first(case: ScheduleCase) -> ScheduleCase:
    first, *rest = case.warmup.stages
    linear = WarmupStageSpec("linear", first.max_iters, 0.5)
    return dataclasses.replace(case, warmup=Warmup((linear, *rest), case.warmup.lr))


def _keyed_wrapper_keeping_zeros(case: Any) -> bool:
    return isinstance(case, ZeroGradCase) and case.wrapper == "keyed_wrapper" and not case.clears


def _fused_sgd_param_groups(case: Any) -> bool:
    return isinstance(case, FusedModuleCase) and case.optimizer == "sgd" and case.param_groups_checked


def _fused_sharded_default_kernel(case: Any) -> bool:
    return isinstance(case, FusedShardedCase) and case.kernel is None


def _fused_sharded_data_parallel(case: Any) -> bool:
    return isinstance(case, FusedShardedCase) and any(entry[0] == "data_parallel" for _, entry in case.plan)


def _without_data_parallel(case: FusedShardedCase) -> FusedShardedCase:
    return dataclasses.replace(case, plan=tuple((table, ("table_wise", 0) if entry[0] == "data_parallel" else entry)
                                                for table, entry in case.plan))


RULES = (
    BrokenCombination("warmup-resume-through-combined-optimizer", _warmup_resume, _without_resume),
    BrokenCombination("resume-with-dense-table-missing-on-a-rank", _missing_on_a_rank, _fused_where_missing, min_world_size=2),
    BrokenCombination("update-hyper-parameters-lr-lost", _lr_through_update_hyper_parameters, _without_lr_update),
    BrokenCombination("semi-sync-local-param-groups-not-restored", _semi_sync_local_lr_saved,
                      lambda case: dataclasses.replace(case, local_lr_factor=1.0)),
    BrokenCombination("warmup-inv-sqrt-first-stage", _inv_sqrt_first, _linear_first),
    BrokenCombination("keyed-optimizer-wrapper-zero-grad-ignores-set-to-none", _keyed_wrapper_keeping_zeros,
                      lambda case: dataclasses.replace(case, set_to_none=True)),
    BrokenCombination("fused-module-sgd-optimizer-lists-no-tables", _fused_sgd_param_groups,
                      lambda case: dataclasses.replace(case, param_groups_checked=False)),
    BrokenCombination("fused-ebc-plan-generators-give-dense-kernel", _fused_sharded_default_kernel,
                      lambda case: dataclasses.replace(case, kernel="fused")),
    BrokenCombination("fused-ebc-data-parallel-cpu-ddp-device-ids", _fused_sharded_data_parallel, _without_data_parallel),
)


def repair(case: Any) -> Any:
    """The case changed so that no rule kept out of the draws on this stack applies to it."""
    for rule in RULES:
        if rule.kept_out() is not None and rule.applies(case):
            case = rule.repair(case)
    return case


def known_broken_cases(world_size: int) -> dict[str, Any]:
    """A minimal reproduction of every rule (sharded ones at ``world_size``)."""
    last = world_size - 1
    pinned = {case.label: case for case in pinned_cases(world_size)}
    round_trip, warm_up, fused_eps = (pinned["state_dict round trip into fresh wrappers, clipping as a safety net"],
                                      pinned["warm-up stages"], pinned["clip norm 2 across ranks, fused eps updated"])
    return {
        "warmup-resume-through-combined-optimizer": dataclasses.replace(
            warm_up, wrapping=dataclasses.replace(warm_up.wrapping, resume_at=3),
            label="warm-up resumed from its state dict"),
        # A dense table on each end of the world: every rank holds a placeholder and fails alike
        # (no rank is left waiting in a collective, so the pool keeps its ranks).
        "resume-with-dense-table-missing-on-a-rank": dataclasses.replace(
            round_trip, plan={**round_trip.plan, "t0": ("table_wise", 0), "t1": ("table_wise", last)},
            label="resumed with dense tables on one rank each"),
        "update-hyper-parameters-lr-lost": dataclasses.replace(
            fused_eps, wrapping=dataclasses.replace(
                fused_eps.wrapping, hyper_parameter_changes=(HyperParameterChange(1, (("lr", 0.02),)),)),
            label="update_hyper_parameters(lr)"),
        "semi-sync-local-param-groups-not-restored": SemiSyncCase(3, 0.7, "adam", resume_at=4, local_lr_factor=0.5),
        "warmup-inv-sqrt-first-stage": ScheduleCase(Warmup((WarmupStageSpec("inv_sqrt", 4),), WARMUP.lr), steps=3),
        "keyed-optimizer-wrapper-zero-grad-ignores-set-to-none": ZeroGradCase("keyed_wrapper", False),
        "fused-module-sgd-optimizer-lists-no-tables": FusedModuleCase(
            "sgd", (("lr", 0.2),), (TableSpec("t0", 6, 4, ("f0",)),), (RankBatch((("f0", ((1, 2), (3,))),)),)),
        "fused-ebc-plan-generators-give-dense-kernel": dataclasses.replace(pinned_fused_sharded_cases(world_size)[0], kernel=None),
        # The pinned case with its table-wise t3 data-parallel instead.
        "fused-ebc-data-parallel-cpu-ddp-device-ids": dataclasses.replace(
            pinned_fused_sharded_cases(world_size)[0],
            plan=tuple((table, ("data_parallel",) if table == "t3" else entry) for table, entry in pinned_fused_sharded_cases(world_size)[0].plan)),
    }

