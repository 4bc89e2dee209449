"""The sync check's gate entry: every budget of the corpus, one case each, then the rank-pool budgets."""

from __future__ import annotations

from typing import Any

from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case
from paritykit.checks.sync.budget import SyncBudget, measure
from paritykit.checks.sync.budgets import BUDGETS, DIST_BUDGETS
from paritykit.checks.sync.dist_budget import WORLD_SIZE, DistSyncBudget, check_dist_budget, measure_dist
from paritykit.checks.sync.inputs import backend_for
from paritykit.sync import check_budget

NAME = "sync"


def run_budget(budget: SyncBudget, config: GateConfig) -> CaseResult:
    """One single-process budget on ``config.device``: within budget, or a failure naming the call sites."""

    def body() -> dict[str, Any]:
        record = measure(budget, config.device)
        limit = budget.budget_on(backend_for(config.device))
        check_budget(record, limit, what=budget.name)
        return {"syncs": record.total, "budget": limit, "by_kind": record.by_kind, "by_site": record.by_site}

    return run_case(NAME, budget.name, config, body)


def run_dist_budget(budget: DistSyncBudget, config: GateConfig, pool: Any) -> CaseResult:
    """One rank-pool budget on ``pool``: every rank within its budget."""

    def body() -> dict[str, Any]:
        records_per_rank, _ = measure_dist(budget, pool, config.device)
        check_dist_budget(budget, records_per_rank)
        return {
            "syncs_per_rank": [[record.total for record in records] for records in records_per_rank],
            "budget_per_rank": list(budget.budgets),
            "by_site_rank0": records_per_rank[0][0].by_site,
        }

    return run_case(NAME, budget.name, config, body)


def run_matrix(config: GateConfig, pools: Any = None) -> list[CaseResult]:
    """Every budget of the corpus on ``config.device``; with ``pools``, also the rank-pool budgets.

    The rank-pool budgets are counts per rank at world size 2: they are skipped (with a reason)
    when the configuration does not select world size 2, and left out when no pools are given.
    """
    results = [run_budget(budget, config) for budget in BUDGETS]
    if pools is None:
        return results
    if WORLD_SIZE not in config.world_sizes:
        return results + [
            CaseResult(NAME, budget.name, "skip", replay=config.replay(NAME), message=f"needs world size {WORLD_SIZE}")
            for budget in DIST_BUDGETS
        ]
    pool = pools.get(WORLD_SIZE)
    return results + [run_dist_budget(budget, config, pool) for budget in DIST_BUDGETS]
