"""The sharding check's embedding towers (tower_cases.py): on every layout the check runs, one host or
several, the pinned towers then drawn ones; and the tower configurations torchrec gets wrong, each run
on purpose once per gate as ``known-broken <rule> ...`` (matched by paritykit/checks/known_issues.toml,
verified on torchrec 1.8.0 and 1.9.2)."""

from __future__ import annotations

from typing import Any

from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_known_broken_case, run_property
from paritykit.checks.sharding.tower_cases import (
    dmp_case, idle_host_case, out_of_order_case, pinned_tower_cases, run_tower_case, tower_cases,
)
from paritykit.harness.hosts import HostLayout

CPU_ONLY = "the tower cases shard on CPU in this version (the sharder is called with no device, as CPU placement needs)"
RULES = {
    "tower-sharding-cpu-ddp-device-ids":
        "DistributedModelParallel (or torchrec's shard()) cannot shard an EmbeddingTowerCollection on CPU: the tower "
        "sharder wraps each tower's interaction in DDP with device_ids=[cpu], which DDP refuses for CPU modules "
        "(DMP's own data-parallel wrapper passes None on CPU)",
    "tower-collection-output-in-host-order":
        "a sharded EmbeddingTowerCollection whose towers are not placed on hosts in the collection's order returns "
        "the towers' output columns in host order: silently permuted against the unsharded collection",
    "tower-sharding-idle-host-desyncs-process-groups":
        "sharding an EmbeddingTowerCollection with a host that holds no tower creates a process group on the tower "
        "hosts' ranks only (ShardingEnv's device mesh over the intra-host group): the ranks' process-group numbering "
        "falls out of step, and the next process group created on every rank hangs",
}


def run_tower_matrix(check: str, config: GateConfig, pools: Any, layouts: list[HostLayout]) -> tuple[list[CaseResult], list[CaseResult]]:
    """(the tower cases' results, the known-broken cases' results)."""
    if config.device != "cpu":
        return [CaseResult(check, "towers", "skip", replay=config.replay(check), message=CPU_ONLY)], []
    results: list[CaseResult] = []
    for hosts in layouts:
        pool = pools.get(hosts.world_size, ranks_per_host=hosts.ranks_per_host if hosts.hosts > 1 else None)
        results += run_property(check, tower_cases(hosts.hosts, hosts.ranks_per_host), lambda case, pool=pool: run_tower_case(case, pool),
                                config, case_id=lambda case: case.case_id(),
                                explicit=pinned_tower_cases(hosts.hosts, hosts.ranks_per_host))
    # A host without a tower, in a collection or a single tower sharded alone (its known-broken case below
    # holds the process groups it desyncs): the numbers.
    for hosts in (h for h in layouts if h.hosts > 1):
        pool = pools.get(hosts.world_size, ranks_per_host=hosts.ranks_per_host)
        for case in (idle_host_case(hosts.hosts, hosts.ranks_per_host, single) for single in (False, True)):
            results.append(run_case(check, f"{case.case_id()} numbers of an idle host", config,
                                    lambda case=case, pool=pool: run_tower_case(case, pool, same_group_count=False)))
    known_broken: list[CaseResult] = []
    smallest = min(layouts, key=lambda h: h.world_size)
    rule = "tower-sharding-cpu-ddp-device-ids"
    case = dmp_case(smallest.world_size)
    pool = pools.get(smallest.world_size, ranks_per_host=smallest.ranks_per_host if smallest.hosts > 1 else None)
    known_broken.append(run_known_broken_case(check, f"known-broken {rule} {case.case_id()}", config, pool,
                                              lambda: run_tower_case(case, pool, via_dmp=True)))
    several = [h for h in layouts if h.hosts > 1]
    if several:
        hosts = min(several, key=lambda h: h.world_size)
        pool = pools.get(hosts.world_size, ranks_per_host=hosts.ranks_per_host)
        # The idle host's case brings the ranks' group numbering level again after it reports the defect.
        for rule, case in (("tower-collection-output-in-host-order", out_of_order_case(hosts.hosts, hosts.ranks_per_host)),
                           ("tower-sharding-idle-host-desyncs-process-groups", idle_host_case(hosts.hosts, hosts.ranks_per_host))):
            known_broken.append(run_known_broken_case(check, f"known-broken {rule} {case.case_id()}", config, pool,
                                                      lambda case=case: run_tower_case(case, pool)))
    return results, known_broken
