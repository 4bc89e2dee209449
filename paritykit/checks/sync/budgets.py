"""The sync budget corpus, in the order the gate runs it: single-process budgets, then rank-pool ones.

Each module named here holds its budgets with the torchrec source that justifies every count.
"""

from __future__ import annotations

from paritykit.checks.sync.budget import SyncBudget
from paritykit.checks.sync.dist_budget import DistSyncBudget
from paritykit.checks.sync.ebc_dist_budgets import EBC_DIST_BUDGETS
from paritykit.checks.sync.ec_budgets import EC_BUDGETS
from paritykit.checks.sync.ec_dist_budgets import EC_DIST_BUDGETS
from paritykit.checks.sync.kjt_budgets import KJT_BUDGETS
from paritykit.checks.sync.regroup_budgets import REGROUP_BUDGETS
from paritykit.checks.sync.vbe_budgets import VBE_BUDGETS

BUDGETS: tuple[SyncBudget, ...] = KJT_BUDGETS + EC_BUDGETS + VBE_BUDGETS + REGROUP_BUDGETS
DIST_BUDGETS: tuple[DistSyncBudget, ...] = EBC_DIST_BUDGETS + EC_DIST_BUDGETS


def _by_name(budgets: tuple) -> dict:
    names = [b.name for b in budgets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"sync budgets named twice: {duplicates}")
    return {b.name: b for b in budgets}


BUDGETS_BY_NAME: dict[str, SyncBudget] = _by_name(BUDGETS)
DIST_BUDGETS_BY_NAME: dict[str, DistSyncBudget] = _by_name(DIST_BUDGETS)
