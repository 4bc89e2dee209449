"""The sharding check's block about how a plan and a table's configuration reach the shards, all
against paritykit's own oracles: torchrec's ``sharding_plan`` helpers as users call them against
paritykit's shard layout (drawn in the caller, no ranks: cheap, so five times the examples), the
helpers' refusals (an unknown sharding type, columns the ranks do not divide), the delta of two plans
(plan_delta_cases.py), and configured
weight-init bounds on never-loaded shards of every sharding type (on the largest world size of the
run)."""

from __future__ import annotations

import dataclasses

from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_known_broken_case, run_property
from paritykit.checks.sharding.init_bounds import init_bounds_cases, run_init_bounds_case
from paritykit.checks.sharding.plan_delta_cases import run_plan_delta_case
from paritykit.checks.sharding.plan_helper_cases import (MISMATCHED_PLANS, UNEVEN_COLUMNS, UNKNOWN_SHARDING_TYPES,
                                                         narrow_column_shards_case, pinned_plan_helper_cases, plan_helper_cases,
                                                         run_mismatched_plans_case, run_plan_helper_case, run_uneven_columns_case,
                                                         run_unknown_types_case)
from paritykit.dist import PoolProvider

# The known-broken cases this block runs once per gate (known_issues.toml).
KNOWN_BROKEN = ("column-wise-shard-width-not-multiple-of-4",)
# Drawn plan-helper examples per --examples: each is a call of torchrec's helpers in the caller.
HELPER_EXAMPLES_FACTOR = 5


def run_plan_matrix(check: str, config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    results = run_property(check, plan_helper_cases(), run_plan_helper_case,
                           dataclasses.replace(config, examples=config.examples * HELPER_EXAMPLES_FACTOR),
                           case_id=lambda case: case.case_id(), explicit=pinned_plan_helper_cases())
    results.append(run_case(check, f"plan-helpers unknown sharding types {list(UNKNOWN_SHARDING_TYPES)}", config,
                            lambda: run_unknown_types_case(UNKNOWN_SHARDING_TYPES)))
    results.append(run_case(check, f"plan-helpers column_wise on uneven columns {list(UNEVEN_COLUMNS)}", config,
                            lambda: run_uneven_columns_case(UNEVEN_COLUMNS)))
    results.append(run_case(check, f"plan-helpers plans for tables the module does not hold {list(MISMATCHED_PLANS)}", config,
                            lambda: run_mismatched_plans_case(MISMATCHED_PLANS)))
    results.append(run_case(check, "plan-helpers the delta of two plans (what moved, its volume, plans of other tables refused)",
                            config, run_plan_delta_case))
    # Column shards whose width is not a multiple of 4 collapse into one (known issue); kept out of the draws.
    narrow = narrow_column_shards_case()
    results.append(run_known_broken_case(check, f"known-broken {KNOWN_BROKEN[0]} {narrow.case_id()}", config,
                                         None, lambda: run_plan_helper_case(narrow)))
    world_size = max(config.world_sizes)
    pool = pools.get(world_size)
    for case in init_bounds_cases(world_size):
        results.append(run_case(check, case.case_id(), config, lambda case=case: run_init_bounds_case(case, pool)))
    return results
