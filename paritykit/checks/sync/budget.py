"""What a single-process sync budget is, and how its region is counted.

Each budget builds its inputs outside the counted region (on the device it is given; host data
declared with ``on_host``), then counts the region on the backend of that device: the CUDA backend
on "cuda", the CPU proxy on "cpu". Every budget is exact and says which torchrec call makes each
sync; the tests assert the count and the torchrec functions the syncs are attributed to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from paritykit.checks.sync.inputs import backend_for
from paritykit.sync import count_syncs


@dataclass(frozen=True)
class SyncBudget:
    """A hot path and the exact number of syncs it makes.

    prepare(device) builds the inputs, uncounted, and returns the region to count; it raises
    UnsupportedByTorchrec when the installed torchrec lacks the feature the region exercises.
    sites: the torchrec functions the syncs are attributed to (checked by the tests).
    kernel_sites: syncs made inside C++ kernels (an fbgemm op sizing its output from device data),
    function -> count. Only the CUDA backend sees them; the CPU proxy cannot (see paritykit.sync.cpu).
    """

    name: str
    budget: int
    prepare: Callable[[torch.device], Callable[[], Any]]
    sites: tuple[str, ...] = ()
    kernel_sites: Mapping[str, int] = field(default_factory=dict)

    def budget_on(self, backend: str) -> int:
        """The exact count on ``backend``: the kernel syncs count only where they can be seen."""
        return self.budget + (sum(self.kernel_sites.values()) if backend == "cuda" else 0)

    def sites_on(self, backend: str) -> frozenset[str]:
        return frozenset(self.sites) | (frozenset(self.kernel_sites) if backend == "cuda" else frozenset())


def measure(budget: SyncBudget, device: str, *, stacks: bool = False):
    """Prepare the budget's inputs on ``device``, count its region, and return the SyncRecord."""
    backend = backend_for(device)
    region = budget.prepare(torch.device(device))
    with count_syncs(backend=backend, stacks=stacks) as record:
        region()
    return record
