"""The planner near a GPU's memory (planning only: the tables live on the meta device, nothing runs on
a GPU): tables that fit the ranks' HBM together only if some of them go to host memory (a UVM
kernel) or are cut by rows. Configured with a storage reservation of its own (torchrec's
``HeuristicalStorageReservation`` at ``RESERVED``), the plan must leave that share of every rank's HBM
free: each rank's chosen shards need at most (1 - RESERVED) of the HBM the topology gives it, and at
most the DDR it gives it.

A planner that reserves less than it is told, or counts HBM it does not have, packs the tables into
HBM and breaks the rule; one that refuses a model that fits (through UVM) fails the case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paritykit.errors import ParityError
from paritykit.harness.noise import quiet_planner

RESERVED = 0.15
HBM_PER_RANK = 64 * 1024 * 1024
# Four tables of 130000 x 64 float32 rows (33 MB each) on two ranks: two per rank need 66.6 MB of the
# 54.4 MB a rank may fill, so the plan must move some to host memory or cut them.
TABLES, ROWS, DIM = 4, 130_000, 64


@dataclass(frozen=True)
class CapacityCase:
    world_size: int = 2

    def case_id(self) -> str:
        return (f"planner capacity: {TABLES} tables of {ROWS}x{DIM} on {self.world_size} GPU ranks of "
                f"{HBM_PER_RANK // 2**20} MiB HBM, {RESERVED:.0%} reserved")


def _gpu_topology(world_size: int) -> Any:
    from torchrec.distributed.planner import types

    factory = getattr(types, "TopologyFactory", None)
    if factory is not None and "hbm_cap_bytes" in getattr(types.TrainerConfig, "__dataclass_fields__", {}):
        return factory.create_topology(
            trainer_config=types.TrainerConfig(world_size=world_size, local_world_size=world_size, hbm_cap_bytes=HBM_PER_RANK),
            kernel_config=types.KernelConfig(compute_device="cuda"))
    return types.Topology(world_size=world_size, compute_device="cuda", local_world_size=world_size, hbm_cap=HBM_PER_RANK)


def run_capacity_case(case: CapacityCase) -> dict[str, Any]:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.sharding_plan import get_default_sharders

    from paritykit.checks.planner.report_rules import recorder

    module = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
                                     for i in range(TABLES)], device=torch.device("meta"))
    chosen = recorder()
    with quiet_planner():
        topology = _gpu_topology(case.world_size)
        capacity = [(device.storage.hbm, device.storage.ddr) for device in topology.devices]
        planner = EmbeddingShardingPlanner(topology=topology, stats=[chosen],
                                           storage_reservation=HeuristicalStorageReservation(percentage=RESERVED))
        planner.plan(module, get_default_sharders())
    used: dict[int, list[int]] = {}
    for option in chosen.best_plan:
        for shard in option.shards:
            per_rank = used.setdefault(shard.rank, [0, 0])
            per_rank[0] += shard.storage.hbm
            per_rank[1] += shard.storage.ddr
    problems = [f"rank {rank}: the plan needs {hbm} bytes of HBM, more than the {1 - RESERVED:.0%} of its {capacity[rank][0]} "
                f"left after the reservation" for rank, (hbm, _) in sorted(used.items()) if hbm > (1 - RESERVED) * capacity[rank][0]]
    problems += [f"rank {rank}: the plan needs {ddr} bytes of DDR, the topology gives it {capacity[rank][1]}"
                 for rank, (_, ddr) in sorted(used.items()) if ddr > capacity[rank][1]]
    if problems:
        kinds = sorted({f"{o.name}:{o.sharding_type}/{o.compute_kernel}" for o in chosen.best_plan})
        raise ParityError(f"{case.case_id()}\n  torchrec's planner filled the reserved memory ({', '.join(kinds)}):\n    "
                          + "\n    ".join(problems))
    return {"ranks": len(used), "hbm_used_max": max(hbm for hbm, _ in used.values()), "plan_shape": "planner/capacity"}
