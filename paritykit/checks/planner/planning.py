"""The case planned by torchrec's EmbeddingShardingPlanner, the way a user plans a model: a topology
of the case's hosts on the ranks' device, the user's ParameterConstraints, torchrec's default sharders;
and every option its EmbeddingEnumerator proposes, estimated (estimate_rules.py holds them to their
meaning)."""

from __future__ import annotations

import dataclasses
from typing import Any

from paritykit.checks.planner.cases import PlannerCase, model_fn
from paritykit.checks.planner.estimate_floors import compute_ceiling_problems, floor_problems
from paritykit.checks.planner.estimate_rules import (batch_problems, bwd_multiplier_problems, cache_problems, ceiling_problems,
                                                     columns_problems, degenerate_problems, num_poolings_problems,
                                                     output_problems, pooling_factor_problems, rows_problems, single_problems,
                                                     weighted_problems)
from paritykit.checks.planner.report_rules import captured_stats_table, recorder, report_problems, storage_per_rank
from paritykit.harness.noise import quiet_planner


def topology(case: PlannerCase, device: str = "cpu", bwd_compute_multiplier: float | None = None) -> Any:
    return topology_of(case.world_size, case.ranks_per_host, device, bwd_compute_multiplier=bwd_compute_multiplier)


def topology_of(world_size: int, ranks_per_host: int, device: str, hbm_cap: int | None = None,
                bwd_compute_multiplier: float | None = None, ddr_cap: int | None = None) -> Any:
    """TopologyFactory where torchrec has it (its recommended way), else Topology itself; ``hbm_cap``,
    ``ddr_cap``: each rank's HBM and DDR in bytes (the device's default when None);
    ``bwd_compute_multiplier``: the topology's (torchrec's default when None)."""
    from torchrec.distributed.planner import types

    cap = {name: value for name, value in (("hbm_cap", hbm_cap), ("ddr_cap", ddr_cap)) if value is not None}
    kernel = {} if bwd_compute_multiplier is None else {"bwd_compute_multiplier": bwd_compute_multiplier}
    factory = getattr(types, "TopologyFactory", None)
    if factory is not None and hasattr(types, "TrainerConfig") and hasattr(types, "KernelConfig"):
        fields = getattr(types.TrainerConfig, "__dataclass_fields__", {})
        if all(f"{name}_bytes" in fields for name in cap):
            trainer_cap = {f"{name}_bytes": value for name, value in cap.items()}
            return factory.create_topology(
                trainer_config=types.TrainerConfig(world_size=world_size, local_world_size=ranks_per_host, **trainer_cap),
                kernel_config=types.KernelConfig(compute_device=device, **kernel))
    return types.Topology(world_size=world_size, compute_device=device, local_world_size=ranks_per_host, **cap, **kernel)


def parameter_constraints(case: PlannerCase) -> dict[str, Any]:
    from torchrec.distributed.planner.types import ParameterConstraints

    return {table: ParameterConstraints(sharding_types=list(c.sharding_types), min_partition=c.min_partition)
            for table, c in case.constraints}


# The share of a table's rows a UVM cache holds, as a user sets it (not torchrec's default).
CACHE_LOAD_FACTOR = 0.3


def traffic_constraints(case: PlannerCase, pooling_factor: float, num_poolings: float) -> dict[str, Any]:
    """Constraints saying only how much each feature of every table is looked up: ``pooling_factor``
    ids per bag and ``num_poolings`` bags per sample (every sharding type and kernel stays open), the
    output's dtype spelled out as float32 (the tables' own: the planner then sizes outputs by it), and
    the UVM cache's load factor."""
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams
    from torchrec.modules.embedding_configs import DataType

    dtype = {"output_dtype": DataType.FP32} if "output_dtype" in {f.name for f in dataclasses.fields(ParameterConstraints)} else {}
    return {t.name: ParameterConstraints(pooling_factors=[pooling_factor] * len(t.feature_names),
                                         num_poolings=[num_poolings] * len(t.feature_names),
                                         cache_params=CacheParams(load_factor=CACHE_LOAD_FACTOR), **dtype) for t in case.tables}


RESERVED_HBM = 0.15  # the share of HBM the planner's default storage reservation keeps


def planned_with_report(case: PlannerCase, module: Any, device: str = "cpu") -> tuple[Any, list[str], list[Any] | None, Any]:
    """torchrec's ShardingPlan for ``module`` (the case's unsharded module), for ranks on ``device``;
    the rows of the statistics table it logged, the sharding options it chose, the topology."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.stats import EmbeddingStats
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.sharding_plan import get_default_sharders

    chosen = recorder()
    with quiet_planner(), captured_stats_table() as rows:
        topo = topology(case, device)
        # the reservation the planner makes by default, given here so that the report's share is known
        planner = EmbeddingShardingPlanner(topology=topo, constraints=parameter_constraints(case),
                                           storage_reservation=HeuristicalStorageReservation(percentage=RESERVED_HBM),
                                           stats=[EmbeddingStats(), chosen])
        plan = planner.plan(module, get_default_sharders())
    return plan, list(rows), chosen.best_plan, topo


def plan_case(case: PlannerCase, module: Any, device: str = "cpu") -> tuple[Any, list[str]]:
    """The plan, and what its statistics report gets wrong about it (report_rules.py)."""
    plan, rows, best_plan, topo = planned_with_report(case, module, device)
    return plan, (report_problems(rows, best_plan, device, topo.world_size, topo, RESERVED_HBM)
                  + capacity_problems(best_plan, topo, device))


def capacity_problems(options: list[Any], topo: Any, device: str, hbm_share: float = 1.0) -> list[str]:
    """Ranks whose planned shards need more DDR than the topology (the one given to the planner,
    which reserves on a copy) gives the rank, or more than ``hbm_share`` of its HBM."""
    problems = []
    for rank, need in sorted(storage_per_rank(options).items()):
        storage = topo.devices[rank].storage
        if need["hbm"] > hbm_share * storage.hbm:
            problems.append(f"rank {rank} on {device}: the plan's shards need {need['hbm']} bytes of hbm, "
                            + (f"the topology gives it {storage.hbm}" if hbm_share == 1.0 else
                               f"more than the {hbm_share:.0%} of its {storage.hbm} left after the reservation"))
        if need["ddr"] > storage.ddr:
            problems.append(f"rank {rank} on {device}: the plan's shards need {need['ddr']} bytes of ddr, the topology gives it {storage.ddr}")
    return problems


# The devices the options are estimated for: the ranks' own, and GPUs (estimates only).
ESTIMATED_FOR = ("cpu", "cuda")


def enumerated(case: PlannerCase, device: str, batch_size: int, constrained: bool, traffic: tuple[float, float] | None = None,
               weighted: bool = False, bwd_compute_multiplier: float | None = None) -> list[Any]:
    """The sharding options torchrec's enumerator proposes, estimated for ``batch_size``: under the
    case's constraints, or every type and kernel the sharders offer (with ``traffic``, the
    (pooling factor, num_poolings) of ``traffic_constraints``); ``weighted``: the EBC's features weighted;
    ``bwd_compute_multiplier``: the topology's."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
    from torchrec.distributed.sharding_plan import get_default_sharders

    with quiet_planner():
        topo = topology(case, device, bwd_compute_multiplier)
        constraints = (parameter_constraints(case) if constrained else
                       traffic_constraints(case, *traffic) if traffic is not None else None)
        estimators = [EmbeddingPerfEstimator(topology=topo, constraints=constraints),
                      EmbeddingStorageEstimator(topology=topo, constraints=constraints)]
        enumerator = EmbeddingEnumerator(topology=topo, batch_size=batch_size, constraints=constraints, estimator=estimators)
        return enumerator.enumerate(model_fn(case, weighted)(), get_default_sharders())


def _scaled(case: PlannerCase, rows: int = 1, columns: int = 1) -> PlannerCase:
    """The case with every table's rows and columns multiplied."""
    return dataclasses.replace(case, tables=tuple(dataclasses.replace(t, num_embeddings=rows * t.num_embeddings,
                                                                      embedding_dim=columns * t.embedding_dim)
                                                  for t in case.tables))


def estimate_problems(case: PlannerCase) -> list[str]:
    """estimate_rules.py's rules on every option for CPU and GPU ranks, at the default batch and twice it
    (under the case's constraints and with none); the first few problems."""
    from torchrec.distributed.planner.constants import BATCH_SIZE, BWD_COMPUTE_MULTIPLIER

    problems = []
    for device in ESTIMATED_FOR:
        for constrained in (True, False):
            single = enumerated(case, device, BATCH_SIZE, constrained)
            if not single:
                problems.append(f"torchrec's enumerator proposed no sharding option on {device}")
                continue
            double = enumerated(case, device, 2 * BATCH_SIZE, constrained)
            problems += (output_problems(single, device, case.module) + single_problems(single, device)
                         + batch_problems(single, double, device)
                         + degenerate_problems(single, device, case.world_size == case.ranks_per_host))
        # Two ids per bag and one bag per sample, then each of them doubled (at least one id per bag:
        # below that a pooled table's output shrinks with its empty bags).
        base = enumerated(case, device, BATCH_SIZE, False, (2.0, 1.0))
        more_ids, more_bags = enumerated(case, device, BATCH_SIZE, False, (4.0, 1.0)), enumerated(case, device, BATCH_SIZE, False, (2.0, 2.0))
        topo = topology(case, device)
        for options in (base, more_ids, more_bags):
            problems += floor_problems(options, device, topo) + compute_ceiling_problems(options, device, topo)
        problems += ceiling_problems(base, device, case.world_size) + cache_problems(base, device, CACHE_LOAD_FACTOR)
        if case.module == "ebc":
            problems += weighted_problems(base, enumerated(case, device, BATCH_SIZE, False, (2.0, 1.0), weighted=True), device)
        problems += pooling_factor_problems(base, more_ids, device) + num_poolings_problems(base, more_bags, device)
        problems += bwd_multiplier_problems(base, enumerated(case, device, BATCH_SIZE, False, (2.0, 1.0),
                                                             bwd_compute_multiplier=2 * BWD_COMPUTE_MULTIPLIER), device)
        problems += rows_problems(base, enumerated(_scaled(case, rows=2), device, BATCH_SIZE, False, (2.0, 1.0)), device,
                                  case.world_size)
        problems += columns_problems(base, enumerated(_scaled(case, columns=2), device, BATCH_SIZE, False, (2.0, 1.0)), device)
    return problems[:4]
