"""paritykit's own shard layout: which rank holds which rows and columns of a table for each of
torchrec's ``sharding_plan`` helpers, derived from what the helpers are documented to do, never from
torchrec's code. The oracle the plan-helper cases (plan_helper_cases.py) hold torchrec's
``ParameterSharding``s to.

A shard is (rank, (row offset, column offset), (rows, columns)). ``W`` ranks in hosts of ``L``:

- ``table_wise(rank=r)``: the whole table on r;
- ``row_wise()``: rows cut into blocks of ceil(R / W), block i on rank i (the last ones may hold
  fewer rows, or none: torchrec's docstring, 10 rows on 4 ranks are 3, 3, 3, 1);
- ``column_wise(ranks=[r0, ..., rn-1])``: columns cut into n equal shards, shard i on ranks[i]
  (ranks in any order, repeats allowed: stitching.py's oracle for how they are put back);
- ``column_wise(size_per_rank=[w0, ..., wn-1])``: shard i of w_i columns, from column w0 + ... +
  w(i-1), on rank i;
- ``table_row_wise(host_index=h)``: rows cut as row-wise over the L ranks of host h, in local order;
- ``grid_shard(host_indexes=[h0, ...])``: columns cut into one block per entry, block b row-wise
  over the ranks of host h_b;
- ``data_parallel()``: a full replica on every rank (no shards);
- table-column-wise: column-wise shards on one host's ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

Shard = tuple[int, tuple[int, int], tuple[int, int]]


@dataclass(frozen=True)
class Layout:
    """What a placement should resolve to: the sharding type, the ranks in shard order, the shards
    (None: a replica on every rank, no sharding spec)."""

    sharding_type: str
    ranks: tuple[int, ...]
    shards: tuple[Shard, ...] | None


def row_blocks(rows: int, parts: int) -> list[tuple[int, int]]:
    """(offset, rows) of each of ``parts`` row blocks of ceil(rows / parts) rows, the last ones short or empty."""
    block = -(-rows // parts)
    return [(min(i * block, rows), max(0, min(block, rows - i * block))) for i in range(parts)]


def column_blocks(columns: int, parts: int) -> list[tuple[int, int]]:
    """(offset, columns) of ``parts`` equal column blocks; ValueError when they are not equal."""
    if parts < 1 or columns % parts:
        raise ValueError(f"{columns} columns do not cut into {parts} equal column shards")
    width = columns // parts
    return [(i * width, width) for i in range(parts)]


def expected_layout(entry: tuple, shape: tuple[int, int], world_size: int, local_size: int) -> Layout:
    """The layout of a normalised plan entry (paritykit's short form: ("column_wise", (0, 1, 0)), ...)."""
    rows, columns = shape
    kind, *args = entry
    if kind == "data_parallel":
        return Layout(kind, tuple(range(world_size)), None)
    if kind == "table_wise":
        return Layout(kind, (args[0],), ((args[0], (0, 0), (rows, columns)),))
    if kind == "row_wise":
        blocks = row_blocks(rows, world_size)
        return Layout(kind, tuple(range(world_size)), tuple((r, (o, 0), (n, columns)) for r, (o, n) in enumerate(blocks)))
    if kind in ("column_wise", "table_column_wise"):
        ranks = tuple(args[0])
        cuts = column_blocks(columns, len(ranks))
        return Layout(kind, ranks, tuple((r, (0, o), (rows, w)) for r, (o, w) in zip(ranks, cuts)))
    if kind == "column_wise_sized":  # shard i, widths[i] columns wide, on rank i
        offsets = [sum(args[0][:i]) for i in range(len(args[0]))]
        return Layout("column_wise", tuple(range(len(args[0]))),
                      tuple((r, (0, o), (rows, w)) for r, (o, w) in enumerate(zip(offsets, args[0]))))
    if kind == "table_row_wise":
        host_ranks = [args[0] * local_size + i for i in range(local_size)]
        blocks = row_blocks(rows, local_size)
        return Layout(kind, tuple(host_ranks), tuple((r, (o, 0), (n, columns)) for r, (o, n) in zip(host_ranks, blocks)))
    if kind == "grid_shard":
        shards = []
        for (column, width), host in zip(column_blocks(columns, len(args[0])), args[0]):
            for local, (offset, count) in enumerate(row_blocks(rows, local_size)):
                shards.append((host * local_size + local, (offset, column), (count, width)))
        return Layout(kind, tuple(s[0] for s in shards), tuple(shards))
    raise ValueError(f"no layout for placement {entry!r}")


def layout_of(sharding, device_type: str) -> tuple[Layout, list[str]]:
    """torchrec's ParameterSharding as a Layout, and the problems of its placements: a shard's
    placement must name its rank and ``device_type``."""
    spec = sharding.sharding_spec
    if spec is None:
        return Layout(sharding.sharding_type, tuple(sharding.ranks or ()), None), []
    shards, problems = [], []
    for shard in spec.shards:
        rank, device = shard.placement.rank(), shard.placement.device()
        if device.type != device_type:
            problems.append(f"shard at {list(shard.shard_offsets)} is placed on {device}, not on {device_type}")
        shards.append((rank, tuple(shard.shard_offsets), tuple(shard.shard_sizes)))
    return Layout(sharding.sharding_type, tuple(sharding.ranks or ()), tuple(shards)), problems


def layout_differences(expected: Layout, found: Layout) -> list[str]:
    """What differs between two layouts, worded for a failure message (empty: they agree)."""
    problems = []
    if expected.sharding_type != found.sharding_type:
        problems.append(f"sharding type {found.sharding_type!r}, expected {expected.sharding_type!r}")
    if expected.ranks != found.ranks:
        problems.append(f"ranks {list(found.ranks)}, expected {list(expected.ranks)}")
    if (expected.shards is None) != (found.shards is None):
        problems.append("a sharding spec where a replica was expected" if expected.shards is None else "no sharding spec")
    elif expected.shards is not None and expected.shards != found.shards:
        problems.append(f"shards (rank, offsets, sizes) {list(found.shards)}, expected {list(expected.shards)}")
    return problems
