"""What a sparse-op sync budget is and how its region is counted (paritykit.sync, CPU proxy on "cpu").

A budget is an op on inputs made beforehand on the device (host data declared with ``on_host``, as
torchrec keeps a VBE KJT's strides on the host) and the exact syncs it makes: how many, and the
torchrec (or fbgemm) function that makes each (``sites``, one entry per sync). The gate fails a
budget that makes more syncs than budgeted or syncs at a site not budgeted; the suite asserts the
count and the sites exactly, so a sync that a release removes shows up too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

from paritykit.errors import ParityError
from paritykit.sync import SyncRecord, check_budget, count_syncs


@dataclass(frozen=True)
class OpBudget:
    """prepare(device) builds the inputs (uncounted) and returns the region to count."""

    name: str
    prepare: Callable[[torch.device], Callable[[], Any]]
    sites: tuple[str, ...] = ()  # the function making each sync, one entry per sync

    @property
    def budget(self) -> int:
        return len(self.sites)


def site_function(site: str) -> str:
    """The function of a call site ``torchrec/sparse/jagged_tensor.py:123 in permute`` -> ``permute``."""
    return site.rpartition(" in ")[2]


def functions_of(record: SyncRecord) -> Counter:
    """How many syncs each function made (its sites at several lines added up)."""
    out: Counter = Counter()
    for site, count in record.by_site.items():
        out[site_function(site)] += count
    return out


def measure(budget: OpBudget, device: str) -> SyncRecord:
    region = budget.prepare(torch.device(device))
    with count_syncs(backend=device) as record:
        region()
    return record


def check_op_budget(budget: OpBudget, record: SyncRecord) -> None:
    """More syncs than budgeted, or a sync at a function the budget does not name: ParityError."""
    check_budget(record, budget.budget, what=budget.name)
    unexpected = functions_of(record) - Counter(budget.sites)
    if unexpected:
        raise ParityError(
            f"{budget.name}: syncs at functions its budget does not name: {dict(unexpected)} "
            f"(budgeted: {dict(Counter(budget.sites)) or 'none'})\n{record.describe()}"
        )
