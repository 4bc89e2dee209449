"""The planner near a GPU's memory (planning only: the tables live on the meta device, nothing runs on
a GPU): tables that fit the ranks' HBM together only if some of them go to host memory (a UVM
kernel) or are cut by rows. Configured with a storage reservation of its own (torchrec's
``HeuristicalStorageReservation`` at ``RESERVED``), the plan must leave that share of every rank's HBM
free, and the reservation's "KJT storage" besides (its documented parts: dense tensors, none here; the
input KJTs; a percentage): two pipelined batches of ten copies each of a batch's int64 ids, the batch
size times the pooling factor (1.0 by default) of every table. Each rank's chosen shards need at most
(1 - RESERVED) of the HBM the topology gives it less those KJT bytes, and at most the DDR it gives it.
At the planner's default batch (512) the KJTs are a third of a MiB; at ``LARGE_BATCH`` they are 20 MiB
and the rank may fill 34.4 of its 64 MiB.

A planner that reserves less than it is told, or counts HBM it does not have, packs the tables into
HBM and breaks the rule; one that refuses a model that fits (through UVM) fails the case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paritykit.checks.planner.planning import capacity_problems, topology_of
from paritykit.checks.planner.report_rules import storage_per_rank
from paritykit.errors import ParityError
from paritykit.harness.noise import quiet_planner

RESERVED = 0.15
HBM_PER_RANK = 64 * 1024 * 1024
# Four tables of 130000 x 64 float32 rows (33 MB each) on two ranks: two per rank need 66.6 MB of the
# 54.4 MB a rank may fill, so the plan must move some to host memory or cut them.
TABLES, ROWS, DIM = 4, 130_000, 64
DEFAULT_BATCH, LARGE_BATCH = 512, 32768
# The reservation's input KJTs: two pipelined batches, ten copies each, of int64 ids.
KJT_COPIES, ID_BYTES, POOLING_FACTOR = 20, 8, 1.0


@dataclass(frozen=True)
class CapacityCase:
    world_size: int = 2
    batch_size: int = DEFAULT_BATCH

    def case_id(self) -> str:
        batch = "" if self.batch_size == DEFAULT_BATCH else f", batch {self.batch_size}"
        return (f"planner capacity: {TABLES} tables of {ROWS}x{DIM} on {self.world_size} GPU ranks of "
                f"{HBM_PER_RANK // 2**20} MiB HBM, {RESERVED:.0%} reserved{batch}")

    def kjt_bytes(self) -> int:
        return int(KJT_COPIES * ID_BYTES * self.batch_size * POOLING_FACTOR * TABLES)


def run_capacity_case(case: CapacityCase) -> dict[str, Any]:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec.distributed.planner.stats import EmbeddingStats

    from paritykit.checks.planner.report_rules import captured_stats_table, recorder, report_problems

    module = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
                                     for i in range(TABLES)], device=torch.device("meta"))
    chosen = recorder()
    with quiet_planner(), captured_stats_table() as rows:
        # The reservation works on a copy: this topology keeps each rank's whole memory.
        topology = topology_of(case.world_size, case.world_size, "cuda", hbm_cap=HBM_PER_RANK)
        planner = EmbeddingShardingPlanner(topology=topology, stats=[EmbeddingStats(), chosen], batch_size=case.batch_size,
                                           storage_reservation=HeuristicalStorageReservation(percentage=RESERVED))
        planner.plan(module, get_default_sharders())
    problems = capacity_problems(chosen.best_plan, topology, "cuda", hbm_share=1 - RESERVED - case.kjt_bytes() / HBM_PER_RANK)
    # Its report too: here the ranks' HBM is mostly used, so each rank's HBM percent is far from 0.
    problems += report_problems(list(rows), chosen.best_plan, "cuda", case.world_size, topology, RESERVED)
    if problems:
        kinds = sorted({f"{o.name}:{o.sharding_type}/{o.compute_kernel}" for o in chosen.best_plan})
        raise ParityError(f"{case.case_id()}\n  torchrec's planner filled the reserved memory or misreported its plan ({', '.join(kinds)}):\n    "
                          + "\n    ".join(problems))
    used = storage_per_rank(chosen.best_plan)
    return {"ranks": len(used), "hbm_used_max": max(need["hbm"] for need in used.values()), "plan_shape": "planner/capacity"}
