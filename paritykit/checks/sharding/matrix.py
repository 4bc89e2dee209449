"""The sharding check's gate entry: pinned and drawn sharded-vs-unsharded cases at each world size,
and the combinations known to fail inside torchrec, run on purpose."""

from __future__ import annotations

from collections import Counter
from typing import Any

from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property
from paritykit.checks.sharding.assertion import assert_sharded_matches_unsharded
from paritykit.checks.sharding.cases import ShardingCase, cw_cases, known_broken_cases, pinned_cases
from paritykit.dist import PoolProvider
from paritykit.errors import HarnessError

NAME = "cw-stitch"


def examples_per_plan_shape(results: list[CaseResult]) -> Counter:
    """How many examples passed per plan shape (so a run cannot pass on nothing)."""
    return Counter(r.metrics.get("plan_shape", "?") for r in results if r.status == "pass")


def _known_broken_result(case: ShardingCase, pool: Any, config: GateConfig) -> CaseResult:
    # Every outcome is reported as it is; the gate matches failures against the known issues.
    return run_case(NAME, f"known-broken {case.describe()}", config, lambda: assert_sharded_matches_unsharded(case, pool))


def run_matrix(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    world_sizes = tuple(w for w in config.world_sizes if w >= 2) or (2,)
    results: list[CaseResult] = []
    known_broken: list[CaseResult] = []
    for world_size in world_sizes:
        pool = pools.get(world_size)
        strategy = cw_cases(world_sizes=(world_size,), device=config.device)
        results += run_property(
            NAME,
            strategy,
            lambda case, pool=pool: assert_sharded_matches_unsharded(case, pool),
            config,
            case_id=lambda case: case.describe(),
            explicit=pinned_cases(world_size, config.device),
        )
        known_broken += [_known_broken_result(case, pool, config) for case in known_broken_cases(world_size, config.device)]
    if not examples_per_plan_shape(results) and not any(r.status == "fail" for r in results):
        results.append(
            CaseResult(
                NAME, "<no examples>", "error", replay=config.replay(NAME),
                message=str(HarnessError("no cw-stitch example ran: every draw was rejected or unsupported")),
            )
        )
    return results + known_broken
