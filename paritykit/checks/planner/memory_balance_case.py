"""torchrec's ``MemoryBalancedPartitioner`` against what it documents (planning only: the tables on the
meta device): it "repeatedly calls the GreedyPerfPartitioner to find a plan with perf within the
tolerance of the original plan that uses the least amount of memory", the original plan being the
greedy partitioner's by perf. Eight table-wise tables of 10 to 150 MB, each with its own pooling
factor, on four GPU ranks, at the default tolerance (2%) and at 50%; each plan must:

- place every shard on a rank of the topology, each table's shards as the proposal cuts them;
- use at most the original plan's HBM on its fullest rank;
- be rated (the largest rank's summed perf, the planner's perf model) within the tolerance of the
  original plan's rating.
"""

from __future__ import annotations

import copy
from typing import Any

from paritykit.errors import HarnessError, ParityError

CASE_ID = "planner memory-balanced partitioner: 8 table-wise tables on 4 GPU ranks, within its tolerance of the greedy plan's perf"
ROWS = (40_000, 300_000, 60_000, 250_000, 80_000, 20_000, 150_000, 100_000)
POOLING = (8.0, 1.0, 6.0, 1.0, 4.0, 10.0, 2.0, 3.0)
COLUMNS, WORLD_SIZE = 128, 4
TOLERANCES = (0.02, 0.5)


def proposal() -> tuple[list[Any], Any]:
    """One table-wise option a table (fused, in HBM), estimated for the topology."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import get_default_sharders

    from paritykit.checks.planner.planning import topology_of
    from paritykit.harness.noise import quiet_planner

    module = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=COLUMNS, feature_names=[f"f{i}"])
                                     for i, rows in enumerate(ROWS)], device=torch.device("meta"))
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"], pooling_factors=[pooling])
                   for i, pooling in enumerate(POOLING)}
    with quiet_planner():
        topology = topology_of(WORLD_SIZE, WORLD_SIZE, "cuda")
        estimators = [EmbeddingPerfEstimator(topology=topology, constraints=constraints),
                      EmbeddingStorageEstimator(topology=topology, constraints=constraints)]
        options = EmbeddingEnumerator(topology=topology, batch_size=512, estimator=estimators,
                                      constraints=constraints).enumerate(module, get_default_sharders())
    if len(options) != len(ROWS):
        raise HarnessError(f"{CASE_ID}: the enumerator offered {len(options)} options for {len(ROWS)} tables constrained to one each")
    return options, topology


def rank_loads(plan: list[Any]) -> tuple[list[int], list[float]]:
    """(HBM, summed perf) of each rank's shards."""
    hbm, perf = [0] * WORLD_SIZE, [0.0] * WORLD_SIZE
    for option in plan:
        for shard in option.shards:
            hbm[shard.rank] += shard.storage.hbm
            perf[shard.rank] += shard.perf.total
    return hbm, perf


def balance_problems(original: list[Any], balanced: list[Any], tolerance: float) -> list[str]:
    problems = []
    for option in balanced:
        ranks = [shard.rank for shard in option.shards]
        if len(ranks) != 1 or not all(isinstance(rank, int) and 0 <= rank < WORLD_SIZE for rank in ranks):
            problems.append(f"table {option.name} placed on ranks {ranks} (expected one rank of {WORLD_SIZE})")
    if problems:
        return problems
    (hbm_before, perf_before), (hbm_after, perf_after) = rank_loads(original), rank_loads(balanced)
    if max(hbm_after) > max(hbm_before):
        problems.append(f"tolerance {tolerance}: the fullest rank holds {max(hbm_after)} bytes of HBM ({hbm_after}), more than the "
                        f"greedy plan's {max(hbm_before)} ({hbm_before})")
    if max(perf_after) > max(perf_before) * (1 + tolerance) * (1 + 1e-9):
        problems.append(f"tolerance {tolerance}: rated {max(perf_after)} (the largest rank's perf), beyond {1 + tolerance:g} x the "
                        f"greedy plan's {max(perf_before)}")
    return problems


def run_memory_balance_case() -> dict[str, Any]:
    from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner, MemoryBalancedPartitioner, SortBy

    from paritykit.harness.noise import quiet_planner

    options, topology = proposal()
    problems, lowest = [], []
    with quiet_planner():
        original = GreedyPerfPartitioner(sort_by=SortBy.PERF).partition(copy.deepcopy(options), topology)
        for tolerance in TOLERANCES:
            balanced = MemoryBalancedPartitioner(tolerance=tolerance).partition(copy.deepcopy(options), topology)
            problems += balance_problems(original, balanced, tolerance)
            lowest.append(max(rank_loads(balanced)[0]))
    if problems:
        raise ParityError(f"{CASE_ID}\n  torchrec's partitioner broke what it documents:\n    " + "\n    ".join(problems))
    return {"tables": len(ROWS), "fullest_rank_hbm": lowest, "plan_shape": "planner/memory-balanced"}
