"""The planner check's gate entry: drawn planner cases on every world size (one host) and on the
config's layouts of several hosts, a few per layout (each trains on its pool), and on each layout the
placements offered to GPU ranks only, planned for cuda and held to the plan's rules; on several hosts,
equal tables spread over them (spread_case.py); the capacity cases, the report on many tables (report_case.py),
the value types, the planner's callbacks, its proposers (proposer_case.py), its refusals
(refusal_case.py) and the memory-balanced partitioner (memory_balance_case.py)."""

from __future__ import annotations

import dataclasses

from paritykit.checks.planner.callback_case import CASE_ID as CALLBACK_CASE_ID
from paritykit.checks.planner.callback_case import run_callback_case
from paritykit.checks.planner.capacity import LARGE_BATCH, CapacityCase, run_capacity_case
from paritykit.checks.planner.case_runner import run_gpu_plan_case, run_planner_case
from paritykit.checks.planner.draws import planner_cases
from paritykit.checks.planner.memory_balance_case import CASE_ID as MEMORY_BALANCE_CASE_ID
from paritykit.checks.planner.memory_balance_case import run_memory_balance_case
from paritykit.checks.planner.pinned import gpu_only_cases, pinned_cases
from paritykit.checks.planner.proposer_case import CASE_ID as PROPOSER_CASE_ID
from paritykit.checks.planner.proposer_case import run_proposer_case
from paritykit.checks.planner.refusal_case import CASE_ID as REFUSAL_CASE_ID
from paritykit.checks.planner.refusal_case import run_refusal_case
from paritykit.checks.planner.report_case import REPORTED_FOR, run_report_case
from paritykit.checks.planner.report_case import case_id as report_case_id
from paritykit.checks.planner.spread_case import run_spread_case, spread_cases
from paritykit.checks.planner.value_types import value_type_case
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property
from paritykit.dist import PoolProvider
from paritykit.harness.hosts import host_layout
from paritykit.harness.plans import local_world_size

NAME = "planner"
# A case plans (tens of milliseconds) and trains two steps on its pool (about a second): the gate
# draws one case per this many examples on each layout, and the pinned ones.
EXAMPLES_PER_CASE = 25


def run_matrix(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    layouts = [host_layout(w, local_world_size(w)) for w in config.world_sizes] + list(config.hosts)
    drawn = dataclasses.replace(config, examples=max(1, config.examples // EXAMPLES_PER_CASE))
    capacities = (CapacityCase(), CapacityCase(batch_size=LARGE_BATCH))
    results: list[CaseResult] = [run_case(NAME, capacity.case_id(), config, lambda capacity=capacity: run_capacity_case(capacity))
                                 for capacity in capacities]
    results += [run_case(NAME, "planner value types: Storage and Perf arithmetic", config, value_type_case),
                run_case(NAME, CALLBACK_CASE_ID, config, run_callback_case),
                run_case(NAME, PROPOSER_CASE_ID, config, run_proposer_case),
                run_case(NAME, REFUSAL_CASE_ID, config, run_refusal_case),
                run_case(NAME, MEMORY_BALANCE_CASE_ID, config, run_memory_balance_case)]
    results += [run_case(NAME, report_case_id(device), config, lambda device=device: run_report_case(device)) for device in REPORTED_FOR]
    for hosts in dict.fromkeys(layouts):
        ranks_per_host = hosts.ranks_per_host if hosts.hosts > 1 else None
        pool = pools.get(hosts.world_size, ranks_per_host=ranks_per_host)
        results += run_property(NAME, planner_cases(hosts.world_size, hosts.ranks_per_host),
                                lambda case, pool=pool: run_planner_case(case, pool), drawn,
                                case_id=lambda case: case.case_id(),
                                explicit=pinned_cases(hosts.world_size, hosts.ranks_per_host))
        for case in gpu_only_cases(hosts.world_size, hosts.ranks_per_host):
            results.append(run_case(NAME, f"{case.case_id()} planned for cuda", config, lambda case=case: run_gpu_plan_case(case)))
        for spread in spread_cases(hosts.hosts, hosts.ranks_per_host):
            results.append(run_case(NAME, spread.case_id(), config, lambda spread=spread: run_spread_case(spread)))
    return results
