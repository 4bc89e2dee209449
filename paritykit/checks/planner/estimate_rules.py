"""What the planner's estimates of every sharding option must mean, whatever their calibration (the
rules; planning.estimate_problems applies them): the options torchrec's EmbeddingEnumerator proposes
for the case's tables (under the user's constraints, and with none: every type and kernel), with its
default perf and storage estimators, on the case's hosts for CPU ranks and for GPU ranks (planning
only: nothing runs on a GPU), at the planner's default batch size and at twice that.

- every perf component is finite and not negative;
- time is bytes moved over a bandwidth, and every byte a shard computes on or sends in a step is one
  of the batch's: each component doubles with the batch, except a data-parallel table's backward
  comms (the all-reduce of its gradient, the size of the table), which does not move;
- a sharding type that degenerates into another estimates as that one does, shard by shard: a
  column-wise or table-column-wise option of one shard is the table-wise placement of the table, and
  on one host a table-row-wise option is the row-wise one (same shards, same transfers);
- each shard's storage holds at least its weights (rows x columns x element size) and, for a pooled
  table, one rank's pooled output of the batch (batch x columns x element size).

The constants of the cost model (bandwidths, penalties) are calibration, not meaning: no rule here
pins them (docs/planner.md).
"""

from __future__ import annotations

import math
from typing import Any

PERF_COMPONENTS = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "prefetch_compute")
# Relative roundoff of a component computed at two batch sizes.
LINEAR_TOLERANCE = 1e-9


def _option_name(option: Any, device: str) -> str:
    return f"table {option.name!r} {option.sharding_type}/{option.compute_kernel} on {device}"


def _storage_least(option: Any, shard: Any) -> int:
    element = option.tensor.element_size()
    rows, columns = shard.size
    return rows * columns * element + (option.batch_size * columns * element if option.is_pooled else 0)


def single_problems(options: list[Any], device: str) -> list[str]:
    """Shards without an estimate, with a negative or infinite perf component, or with less storage
    than their weights and (pooled) one rank's output. Also applied to the plan the planner chose."""
    problems = []
    for option in options:
        for shard in option.shards:
            where = f"{_option_name(option, device)}, shard {shard.size} at {shard.offset}"
            if shard.perf is None or shard.storage is None:
                problems.append(f"{where}: no perf or storage estimate")
                continue
            bad = [c for c in PERF_COMPONENTS if not math.isfinite(getattr(shard.perf, c)) or getattr(shard.perf, c) < 0]
            if bad:
                problems.append(f"{where}: perf {', '.join(f'{c}={getattr(shard.perf, c)}' for c in bad)}")
            held, least = shard.storage.hbm + shard.storage.ddr + getattr(shard.storage, "ssd", 0), _storage_least(option, shard)
            if held < least:
                problems.append(f"{where}: storage {held} bytes, less than its weights"
                                + (" and one rank's pooled output" if option.is_pooled else "") + f" ({least} bytes)")
    return problems


def batch_problems(single: list[Any], double: list[Any], device: str) -> list[str]:
    """Components that do not double with the batch (the data-parallel all-reduce: do not move)."""
    key = lambda option: (option.name, option.sharding_type, option.compute_kernel, len(option.shards))  # noqa: E731
    doubled = {key(option): option for option in double}
    problems = []
    for option in single:
        other = doubled.get(key(option))
        if other is None:
            problems.append(f"{_option_name(option, device)}: proposed at batch {option.batch_size}, not at {2 * option.batch_size}")
            continue
        for shard, twice in zip(option.shards, other.shards):
            for component in PERF_COMPONENTS:
                before, after = getattr(shard.perf, component), getattr(twice.perf, component)
                fixed = option.sharding_type == "data_parallel" and component == "bwd_comms"
                expected = before if fixed else 2 * before
                if abs(after - expected) > LINEAR_TOLERANCE * max(abs(expected), abs(after)):
                    problems.append(f"{_option_name(option, device)}, shard {shard.size} at {shard.offset}: {component} "
                                    f"{before} at batch {option.batch_size}, {after} at {other.batch_size} "
                                    f"(expected {'the same' if fixed else 'twice'})")
    return problems


def _estimates(option: Any) -> list[tuple]:
    return [tuple(getattr(shard.perf, c) for c in PERF_COMPONENTS) + (shard.storage.hbm, shard.storage.ddr, tuple(shard.size))
            for shard in option.shards]


def degenerate_problems(options: list[Any], device: str, one_host: bool) -> list[str]:
    """Options of a degenerate type whose estimates differ from those of the type they equal."""
    by_table: dict[tuple[str, str], dict[str, Any]] = {}
    for option in options:
        by_table.setdefault((option.name, option.compute_kernel), {})[option.sharding_type] = option
    problems = []
    for kinds in by_table.values():
        pairs = [(kind, "table_wise") for kind in ("column_wise", "table_column_wise")
                 if kind in kinds and len(kinds[kind].shards) == 1]
        pairs += [("table_row_wise", "row_wise")] if one_host else []
        for kind, equal in pairs:
            if kind not in kinds or equal not in kinds:
                continue
            found, expected = _estimates(kinds[kind]), _estimates(kinds[equal])
            if len(found) != len(expected) or any(not math.isclose(a, b, rel_tol=LINEAR_TOLERANCE) for x, y in zip(found, expected)
                                                  for a, b in zip(x[:-1], y[:-1])):
                problems.append(f"{_option_name(kinds[kind], device)} is the {equal} placement of the table "
                                f"({len(found)} shard(s)), estimated {found[:2]}, {equal} estimated {expected[:2]}")
    return problems
