"""The stats table's "Compute Kernels Count" block against the plan it describes: under the heading,
one row per compute kernel of the chosen plan, ``<kernel>: <how many tables were planned with it>``."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

HEADING = "Compute Kernels Count:"


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
