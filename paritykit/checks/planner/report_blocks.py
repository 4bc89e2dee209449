"""Blocks of the planner's stats table held on their own against the plan they describe:

- "Compute Kernels Count": under the heading, one row per compute kernel of the chosen plan,
  ``<kernel>: <how many tables were planned with it>``;
- the peak HBM pressure tiers under "Top HBM Memory Usage Estimation": numbered 1, 2, ... from the
  highest, each on ranks no other tier names, at least one, and every rank named when there are
  fewer tiers than torchrec's five (each rank's HBM is in some tier then).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

HEADING = "Compute Kernels Count:"
TOP_HBM = "Top HBM Memory Usage Estimation"
MOST_TIERS = 5  # torchrec's NUM_PEAK_RANK


def printed_kernel_counts(rows: list[str]) -> dict[str, int] | None:
    """{kernel: count} as printed under the heading (None: no such block)."""
    start = next((i for i, row in enumerate(rows) if HEADING in row), None)
    if start is None:
        return None
    counts: dict[str, int] = {}
    for row in rows[start + 1:]:
        found = re.match(r"#\s+(\w+): (\d+)\s*#$", row.strip())
        if not found:
            break
        counts[found.group(1)] = int(found.group(2))
    return counts


def kernel_count_problems(rows: list[str], best_plan: list[Any]) -> list[str]:
    expected = dict(Counter(option.compute_kernel for option in best_plan))
    printed = printed_kernel_counts(rows)
    if printed is None:
        return [f"the stats table has no {HEADING!r} block"]
    if printed != expected:
        return [f"{HEADING} printed {printed}; the plan's tables per compute kernel are {expected}"]
    return []


def printed_ranks(cell: str) -> list[int]:
    """The ranks a cell names, sorted: '0-3', '0,0,1', '0-2,5' (torchrec collapses consecutive ranks); [] for other text."""
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", cell):
        return []
    ranks: list[int] = []
    for part in cell.split(","):
        first, _, last = part.partition("-")
        ranks += list(range(int(first), int(last or first) + 1))
    return sorted(ranks)


def tier_problems(rows: list[str], world_size: int) -> list[str]:
    tiers = [(int(n), float(gb), printed_ranks(ranks)) for n, gb, ranks in
             (m.groups() for m in (re.search(r"Top Tier #(-?\d+) Estimated Peak HBM Pressure: ([0-9.]+) GB on ranks? (\S+)", row)
                                   for row in rows) if m)]
    numbers = sorted(n for n, _, _ in tiers)
    by_number = sorted(tiers)
    named = [rank for _, _, ranks in tiers for rank in ranks]
    if numbers != list(range(1, len(tiers) + 1)) or any(a[1] < b[1] for a, b in zip(by_number, by_number[1:])) \
            or len(named) != len(set(named)):
        return [f"the stats table's peak HBM pressure tiers {[(n, gb, r) for n, gb, r in tiers]} are not numbered 1, 2, ... "
                "from the highest, each on ranks of its own"]
    if any(TOP_HBM in row for row in rows) and (not tiers or (len(tiers) < MOST_TIERS and sorted(named) != list(range(world_size)))):
        return [f"the stats table's peak HBM pressure tiers {[(n, gb, r) for n, gb, r in tiers]} name ranks {sorted(named)}; "
                f"with fewer than {MOST_TIERS} tiers every rank of {world_size} is in one"]
    return []
