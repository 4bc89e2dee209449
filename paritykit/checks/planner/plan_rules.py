"""What a plan must be, whatever torchrec's planner chose, written out from the meaning of the user's
constraints and of each sharding type (independent of torchrec's planner and shard arithmetic):

- every table is planned, with a sharding type the user allowed, and a kernel the sharder offers
  for it on the ranks' device;
- its ranks exist, and each shard's placement is the rank listed for it, in order, on the rank's own
  device (a GPU rank's ``cuda:<local rank>``);
- table-wise: one shard, the whole table; data-parallel: every rank, no shards;
- column-wise and table-column-wise: shards of all the rows, side by side from column 0 to the last,
  of equal width: the smallest multiple of 4 that is at least ``min_partition`` (128 when not given)
  and divides the dimension, or the whole dimension when none does; table-column-wise keeps every
  shard on one host;
- row-wise: one shard per rank in rank order, of ceil(rows / ranks) rows each until the rows run out;
- table-row-wise: the same over the ranks of one host; grid: the column blocks above, each split so
  over the ranks of one host (torchrec offers both for GPU ranks only: plans made for cuda).
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.checks.planner.cases import PlannerCase
from paritykit.harness.plans import row_shard_sizes
from paritykit.harness.tables import TableSpec

DEFAULT_MIN_PARTITION = 128  # torchrec's documented default for min_partition (planner/constants.py MIN_CW_DIM)
COLUMN_WISE = ("column_wise", "table_column_wise")


def column_block(dim: int, min_partition: int | None) -> int:
    """The width of every column-wise shard of a ``dim``-wide table."""
    lower = min_partition or DEFAULT_MIN_PARTITION
    return next((width for width in range(lower, dim) if dim % width == 0 and width % 4 == 0), dim)


def _shards(sharding: Any) -> list[tuple[list[int], list[int], int]]:
    spec = sharding.sharding_spec
    return [] if spec is None else [(list(s.shard_offsets), list(s.shard_sizes), s.placement.rank()) for s in spec.shards]


def _column_problem(case: PlannerCase, table: TableSpec, sharding: Any, shards: list) -> str | None:
    block = column_block(table.embedding_dim, case.constraint_of(table.name).min_partition)
    expected = [([0, column], [table.num_embeddings, block]) for column in range(0, table.embedding_dim, block)]
    if sorted((offsets, sizes) for offsets, sizes, _ in shards) != expected:
        return (f"its shards (offsets, sizes) are {[(o, s) for o, s, _ in shards]}; the columns in blocks of {block} "
                f"(min_partition {case.constraint_of(table.name).min_partition}) are {expected}")
    if sharding.sharding_type == "table_column_wise" and len({case.hosts.host_of(rank) for _, _, rank in shards}) > 1:
        return f"its table-column-wise shards are on ranks {[rank for _, _, rank in shards]}, on more than one host"
    return None


def _layout_problem(case: PlannerCase, table: TableSpec, sharding: Any) -> str | None:
    kind, shards = sharding.sharding_type, _shards(sharding)
    ranks = list(sharding.ranks or [])
    if any(not 0 <= rank < case.world_size for rank in ranks):
        return f"its ranks {ranks} are not all ranks of a world of {case.world_size}"
    if kind == "data_parallel":
        return None if sorted(ranks) in ([], list(range(case.world_size))) else f"data-parallel on ranks {ranks}, not on every rank"
    if [rank for _, _, rank in shards] != ranks:
        return f"its shards are placed on ranks {[rank for _, _, rank in shards]} but the plan lists ranks {ranks}"
    whole = ([0, 0], [table.num_embeddings, table.embedding_dim])
    if kind == "table_wise":
        return None if [(o, s) for o, s, _ in shards] == [whole] else f"table-wise shards {shards}, not the whole table once"
    if kind in COLUMN_WISE:
        return _column_problem(case, table, sharding, shards)
    if kind == "row_wise":
        expected = _rows_over(table.num_embeddings, 0, table.embedding_dim, list(range(case.world_size)))
        return None if shards == expected else f"row-wise shards {shards}; one per rank in rank order is {expected}"
    if kind in ("table_row_wise", "grid_shard"):
        return _host_rows_problem(case, table, shards, kind)
    return f"sharding type {kind!r} has no rule here"


def _rows_over(rows: int, column: int, width: int, ranks: list[int]) -> list:
    """(offsets, sizes, rank): the rows in ceil(rows / len(ranks)) blocks over ``ranks`` in order."""
    sizes = row_shard_sizes(rows, len(ranks))
    return [([sum(sizes[:i]), column], [size, width], rank) for i, (size, rank) in enumerate(zip(sizes, ranks))]


def _host_rows_problem(case: PlannerCase, table: TableSpec, shards: list, kind: str) -> str | None:
    """Table-row-wise: the rows over one host's ranks. Grid: each column block (as column-wise) so."""
    width = table.embedding_dim if kind == "table_row_wise" else column_block(table.embedding_dim,
                                                                             case.constraint_of(table.name).min_partition)
    expected_columns = list(range(0, table.embedding_dim, width))
    found_columns = sorted({offsets[1] for offsets, _, _ in shards})
    if found_columns != expected_columns:
        return f"its shards start at columns {found_columns}; blocks of {width} columns start at {expected_columns}"
    for column in expected_columns:
        block = [shard for shard in shards if shard[0][1] == column]
        host = case.hosts.host_of(block[0][2])
        ranks = [rank for rank in range(case.world_size) if case.hosts.host_of(rank) == host]
        expected = _rows_over(table.num_embeddings, column, width, ranks)
        if block != expected:
            return f"the shards of columns {column}.. are {block}; the rows over host {host}'s ranks in order are {expected}"
    return None


def placement_problem(case: PlannerCase, sharding: Any, device: str) -> str | None:
    """A shard placed on another device than its rank's own: ``cuda:<local rank>`` on a GPU rank (each
    rank of a host drives the GPU of its local rank), ``cpu`` on a CPU rank."""
    for shard in (sharding.sharding_spec.shards if sharding.sharding_spec is not None else ()):
        rank, placed = shard.placement.rank(), shard.placement.device()
        want = torch.device("cuda", rank % case.ranks_per_host) if device == "cuda" else torch.device(device)
        if placed != want:
            return f"its shard at {list(shard.shard_offsets)} is placed on rank {rank}'s {placed}, not {want}"
    return None


def plan_problems(case: PlannerCase, plan: Any, kernels_offered: dict[str, tuple[str, ...]], device: str | None = None) -> list[str]:
    """Every way the planned ``plan`` breaks the rules above, naming the table.
    ``kernels_offered``: the compute kernels torchrec's sharder lists per sharding type on the device;
    ``device``: the ranks' device type, whose placements the shards must name (not checked when None)."""
    planned = {name: sharding for module_plan in plan.plan.values() for name, sharding in module_plan.items()}
    problems = []
    for table in case.tables:
        sharding = planned.get(table.name)
        if sharding is None:
            problems.append(f"table {table.name!r} is not in the plan (planned: {sorted(planned)})")
            continue
        allowed = case.constraint_of(table.name).sharding_types
        if sharding.sharding_type not in allowed:
            problems.append(f"table {table.name!r} is planned {sharding.sharding_type}; its constraints allow only {list(allowed)}")
            continue
        if sharding.compute_kernel not in kernels_offered.get(sharding.sharding_type, ()):
            problems.append(f"table {table.name!r} ({sharding.sharding_type}) has kernel {sharding.compute_kernel!r}; "
                            f"the sharder offers {list(kernels_offered.get(sharding.sharding_type, ()))} on the device")
        problem = _layout_problem(case, table, sharding) or (placement_problem(case, sharding, device) if device else None)
        if problem:
            problems.append(f"table {table.name!r} ({sharding.sharding_type}): {problem}")
    return problems
