"""The planner spreading equal tables (``GreedyPerfPartitioner``, the default partitioner): ``count``
table-wise tables of the same size and traffic, at most one a rank, on ``hosts`` hosts of
``ranks_per_host`` ranks. Greedy by load, each table goes to a rank that holds none yet; ranks that
tie are taken by local rank first ("so that we don't overload a single host's DDR limit", torchrec's
comment on the tie-break), so the hosts' counts of tables differ by at most one.

The oracle is that meaning, not the partitioner's order: which rank of a host gets a table is left
open. A tie-break that takes the ranks in rank order fills the first host before the next.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from paritykit.errors import HarnessError, ParityError


@dataclass(frozen=True)
class SpreadCase:
    hosts: int
    ranks_per_host: int
    count: int

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def case_id(self) -> str:
        return (f"planner spread: {self.count} equal table-wise tables on {self.hosts} hosts x {self.ranks_per_host} ranks "
                "(one a rank, hosts within one table of each other)")


def spread_cases(hosts: int, ranks_per_host: int) -> tuple[SpreadCase, ...]:
    """From one table a host to one a rank (nothing to spread on one host)."""
    if hosts < 2:
        return ()
    return tuple(SpreadCase(hosts, ranks_per_host, count) for count in sorted({hosts, hosts + 1, hosts * ranks_per_host})
                 if count <= hosts * ranks_per_host)


def run_spread_case(case: SpreadCase) -> dict[str, Any]:
    import torch
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from paritykit.checks.planner.planning import topology_of
    from paritykit.harness.noise import quiet_planner

    names = [f"t{i}" for i in range(case.count)]
    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=64, embedding_dim=16, feature_names=[f"f_{n}"])
                                            for n in names], device=torch.device("meta"))
    with quiet_planner():
        planner = EmbeddingShardingPlanner(topology=topology_of(case.world_size, case.ranks_per_host, "cpu"),
                                           constraints={n: ParameterConstraints(sharding_types=["table_wise"]) for n in names})
        plan = planner.plan(module, get_default_sharders())
    placed = {name: list(sharding.ranks or []) for name, sharding in plan.plan[""].items()}
    if sorted(placed) != names or any(len(ranks) != 1 for ranks in placed.values()):
        raise HarnessError(f"{case.case_id()}: the plan is not one table-wise rank a table: {placed}")
    ranks = [ranks[0] for ranks in placed.values()]
    per_host = Counter(rank // case.ranks_per_host for rank in ranks)
    counts = [per_host.get(host, 0) for host in range(case.hosts)]
    if len(set(ranks)) != len(ranks):
        raise ParityError(f"{case.case_id()}\n  torchrec's planner put two equal tables on one rank while others hold none: {placed}")
    if max(counts) - min(counts) > 1:
        raise ParityError(f"{case.case_id()}\n  torchrec's planner put {counts} tables on the hosts (by host): {placed}; "
                          "ranks of equal load are to be taken by local rank first, one host at a time")
    return {"tables": case.count, "hosts": case.hosts, "plan_shape": "planner/spread"}
