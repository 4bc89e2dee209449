"""The stats table's summary figures, held against the plan the planner chose (report_rules.py holds the
rest of the table):

- the critical path, as the table's own model defines it (torchrec's ``_calculate_critical_path``
  docstring): ranks synchronize after each of forward and backward communication and computation, and
  communication also after each module and sharding type; so its comms part is, over each (module,
  sharding type, direction), the largest of the ranks' summed comms, summed, its compute part, over
  each direction, the largest of the ranks' summed compute, summed, and the whole their sum;
- the tables "causing" the maximum perf and HBM: the plan's tables other than data-parallel and
  row-wise ones (which every rank holds a part of) with a shard on every rank of the largest total, the
  largest first by the first shard's perf or HBM, at most five; each HBM entry gives that shard's HBM
  (GB, 3 decimals) and the ranks of the table's shards.
"""

from __future__ import annotations

import re
from typing import Any

GB = 1024**3
# The critical path is printed rounded to 3 decimals (ms).
PRINTED_PERF_UNIT = 1e-3
TOP_TABLES = 5
# Spread over every rank: never the tables "causing" one rank's maximum.
SPREAD_TYPES = ("data_parallel", "row_wise")


def critical_path(best_plan: list[Any]) -> tuple[float, float]:
    """(comms, compute) of the plan's critical path (the module docstring)."""
    comms: dict[tuple, dict[int, float]] = {}
    compute: dict[str, dict[int, float]] = {}
    for option in best_plan:
        for shard in option.shards:
            for direction in ("fwd", "bwd"):
                per_rank = comms.setdefault((option.module, option.sharding_type, direction), {})
                per_rank[shard.rank] = per_rank.get(shard.rank, 0.0) + getattr(shard.perf, f"{direction}_comms")
                per_rank = compute.setdefault(direction, {})
                per_rank[shard.rank] = per_rank.get(shard.rank, 0.0) + getattr(shard.perf, f"{direction}_compute")
    return (sum(max(ranks.values()) for ranks in comms.values()), sum(max(ranks.values()) for ranks in compute.values()))


def critical_path_problems(rows: list[str], best_plan: list[Any]) -> list[str]:
    """The printed critical path (3 decimals) against ``critical_path`` (a stack that prints none: none)."""
    comms, compute = critical_path(best_plan)
    problems = []
    for label, value in (("comms", comms), ("compute", compute), ("comms + compute", comms + compute)):
        found = next(filter(None, (re.search(rf"Critical Path \({re.escape(label)}\): (\S+)", row) for row in rows)), None)
        if found is not None and abs(float(found.group(1)) - value) > PRINTED_PERF_UNIT / 2 + 1e-9 * max(1.0, value):
            problems.append(f"the stats table prints Critical Path ({label}): {found.group(1)}, the plan's shards give {value:.4f} "
                            f"(comms {comms:.4f}: per module, sharding type and direction the largest rank's sum; compute "
                            f"{compute:.4f}: per direction the largest rank's sum)")
    return problems


def _listed(rows: list[str], title: str) -> list[str] | None:
    """The entries under ``title`` up to the next titled row or the border; None where not printed."""
    start = next((i for i, row in enumerate(rows) if title in row), None)
    if start is None:
        return None
    entries = []
    for row in rows[start + 1:]:
        if not row.startswith("#    "):  # entries are indented; a title or the border ends the list
            break
        entries.append(row.strip("#").strip())
    return entries


def top_tables(best_plan: list[Any], key: str) -> tuple[list[Any], dict[str, float]]:
    """The options that may be listed for ``key`` ("perf" or "hbm") and each one's ordering value (its first
    shard's), in the plan's order; none with fewer than two ranks."""
    totals: dict[int, float] = {}
    for option in best_plan:
        for shard in option.shards:
            totals[shard.rank] = totals.get(shard.rank, 0.0) + (shard.perf.total if key == "perf" else shard.storage.hbm)
    if len(totals) <= 1:
        return [], {}
    top = max(totals.values())
    busiest = {rank for rank, total in totals.items() if total == top}
    eligible = [option for option in best_plan
                if option.sharding_type not in SPREAD_TYPES and {shard.rank for shard in option.shards} >= busiest]
    value = {option.name: (option.shards[0].perf.total if key == "perf" else option.shards[0].storage.hbm) for option in eligible}
    return eligible, value


def top_table_problems(rows: list[str], best_plan: list[Any]) -> list[str]:
    problems = []
    for key, title in (("perf", "Top 5 Tables Causing Max Perf:"), ("hbm", "Top 5 Tables Causing Max HBM:")):
        entries = _listed(rows, title)
        if entries is None:
            continue
        eligible, value = top_tables(best_plan, key)
        names = [entry.split(":", 1)[0] for entry in entries]
        want = min(TOP_TABLES, len(eligible))
        unknown = [name for name in names if name not in value]
        if unknown or len(names) != want or len(set(names)) != len(names):
            problems.append(f"the stats table's {title!r} lists {names}; the plan's tables with a shard on every rank of the largest "
                            f"{key} (not data-parallel or row-wise) are {sorted(value)}: it lists the {want} largest")
            continue
        listed = [value[name] for name in names]
        left = [v for name, v in value.items() if name not in names]
        if listed != sorted(listed, reverse=True) or (left and min(listed, default=0) < max(left)):
            problems.append(f"the stats table's {title!r} lists {names} (their first shards' {key} {listed}), not the largest first "
                            f"of {dict(sorted(value.items()))}")
        if key == "hbm":
            options = {option.name: option for option in eligible}
            for entry, name in zip(entries, names):
                shards = options[name].shards
                text = (f"{name}: {round(shards[0].storage.hbm / GB, 3)} GB on {'ranks' if len(shards) > 1 else 'rank'} "
                        f"{[shard.rank for shard in shards]}")
                if entry != text:
                    problems.append(f"the stats table's {title!r} entry {entry!r}: the plan's shards of {name} give {text!r}")
    return problems
