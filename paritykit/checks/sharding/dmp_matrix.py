"""The sharding check's DMP and collectives block, at every world size of two ranks or more: the pinned
DMP cases (dmp_cases.py), torchrec's pooled collectives on their own (collective_cases.py), its
collective control flow (leader_cases.py), its collective validation (validation_cases.py), its model
delta tracker (delta_tracker_cases.py), DMP.reshard with optimizer state (dmp_reshard_cases.py); and
the known-broken DMP configurations (dmp_known_broken.py) once, on the smallest such world size. On the
pools that stand for several hosts: the reshards of three ranks and more, and the collectives and the
control flow on subgroups. One rank has nothing to communicate: torchrec's collectives return early there."""

from __future__ import annotations

from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_known_broken_case
from paritykit.checks.sharding.collective_cases import collective_cases, run_collective_case, subgroup_collective_cases
from paritykit.checks.sharding.delta_tracker_cases import run_tracker_case, tracker_cases
from paritykit.checks.sharding.dmp_cases import dmp_cases, run_dmp_case
from paritykit.checks.sharding.dmp_known_broken import known_broken_dmp_cases
from paritykit.checks.sharding.dmp_reshard_cases import reshard_cases, reshards_beyond_two_ranks
from paritykit.checks.sharding.dmp_surface import run_surface_case, surface_cases
from paritykit.checks.sharding.leader_cases import leader_cases, run_leader_case, subgroup_leader_cases
from paritykit.checks.sharding.validation_cases import run_validation_case, validation_cases
from paritykit.dist import PoolProvider

MIN_WORLD_SIZE = 2


def run_dmp_matrix(check: str, config: GateConfig, pools: PoolProvider) -> tuple[list[CaseResult], list[CaseResult]]:
    """(results of the DMP cases, results of the known-broken DMP cases)."""
    sizes = [w for w in config.world_sizes if w >= MIN_WORLD_SIZE]
    results: list[CaseResult] = []
    for world_size in sizes:
        pool = pools.get(world_size)
        for case in dmp_cases(world_size) + reshard_cases(world_size):
            results.append(run_case(check, case.case_id(), config, lambda case=case, pool=pool: run_dmp_case(case, pool)))
        for surface in surface_cases(world_size):
            results.append(run_case(check, surface.case_id(), config, lambda surface=surface, pool=pool: run_surface_case(surface, pool)))
        for collective in collective_cases(world_size):
            results.append(run_case(check, collective.case_id(), config,
                                    lambda collective=collective, pool=pool: run_collective_case(collective, pool)))
        for leader in leader_cases(world_size):
            results.append(run_case(check, leader.case_id(), config, lambda leader=leader, pool=pool: run_leader_case(leader, pool)))
        for tracker in tracker_cases(world_size):
            results.append(run_case(check, tracker.case_id(), config, lambda tracker=tracker, pool=pool: run_tracker_case(tracker, pool)))
        for validation in validation_cases(world_size):
            results.append(run_case(check, validation.case_id(), config,
                                    lambda validation=validation, pool=pool: run_validation_case(validation, pool)))
    # On the pools that stand for several hosts: the reshards of three ranks and more (a rank sending a second
    # local shard, a column block split between two new ones, transfers within and across hosts) unless a
    # world size drew them already, and the collectives and the control flow on subgroups.
    for hosts in config.hosts:
        pool = pools.get(hosts.world_size, ranks_per_host=hosts.ranks_per_host)
        if not any(reshards_beyond_two_ranks(w) for w in sizes):
            for case in reshards_beyond_two_ranks(hosts.world_size):
                results.append(run_case(check, case.case_id(), config, lambda case=case, pool=pool: run_dmp_case(case, pool)))
        for collective in subgroup_collective_cases(hosts.world_size):
            results.append(run_case(check, collective.case_id(), config,
                                    lambda collective=collective, pool=pool: run_collective_case(collective, pool)))
        for leader in subgroup_leader_cases(hosts.world_size):
            results.append(run_case(check, leader.case_id(), config, lambda leader=leader, pool=pool: run_leader_case(leader, pool)))
    known_broken: list[CaseResult] = []
    if sizes:
        pool = pools.get(min(sizes))
        for case_id, body in known_broken_dmp_cases(min(sizes)).values():
            known_broken.append(run_known_broken_case(check, case_id, config, pool, lambda body=body, pool=pool: body(pool)))
    return results, known_broken
