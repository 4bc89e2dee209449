"""DMP.reshard mid-training with optimizer state, held to the unsharded model trained straight through
(the same oracle as every DMP case: tables, dense parameters and the fused optimizer's state after every
step, gathered from the new placement).

torchrec's dynamic resharding (torchrec/distributed/sharding/dynamic_sharding.py, the same on 1.8.0 and
1.9.2) moves a table to other ranks within its sharding type (table-wise or column-wise; it keeps the
old sharding infos when the type changes), sends each column shard's slice of the weights and of the
table's optimizer state ``momentum1`` (2-D for Adagrad, 1-D for row-wise Adagrad) point to point, and
receives into one local shard per rank. On gloo a rank cannot send to itself, so every case moves each
column piece to another rank. The cases:

- two ranks and more: table-wise and column-wise tables moved under Adagrad (2-D state) and row-wise
  Adagrad (1-D state: a 2-D slice of it is an error);
- three ranks and more: column-wise ``[0, 1, 0]`` moved to ``[2, 0, 1]`` (rank 0 sends its second local
  shard: local shard indices accumulate), and a table cut into 2 column blocks moved to 3 (each source
  block is split between two new blocks at a running offset, a new block receives two pieces into
  one shard). The split moves weights only (SGD): with Adagrad torchrec sends a non-contiguous slice
  of the 2-D state and fails ("input tensor has to be contiguous"; docs/sharding.md, not yet a
  known-broken case).

Row-wise tables are not resharded: torchrec asserts a table-wise or column-wise destination. Row-wise
Adagrad across a change of column blocks is not compared (the new block's accumulator would be the
width-weighted mean of the old blocks it covers; torchrec copies whole received accumulators, last wins).
"""

from __future__ import annotations

from paritykit.checks.sharding.dmp_cases import DmpCase, _ebc, _steps, _tables
from paritykit.engine.dmp_options import DmpOptions

# Three column blocks of 8 and two of 12: every block a multiple of torchrec's 4-column alignment.
SPLIT_WIDTH = 24


def reshard_cases(world_size: int) -> tuple[DmpCase, ...]:
    """The resharding cases at ``world_size`` (2 or more)."""
    last = world_size - 1
    before = {"t0": ("table_wise", last), "t1": ("column_wise", (0, last)), "t2": ("table_wise", last)}
    after = {"t0": ("table_wise", 0), "t1": ("column_wise", (last, 0)), "t2": ("table_wise", last)}
    cases = [DmpCase("reshard-rowwise", _ebc(world_size, before, 60, "rowwise_adagrad"), DmpOptions(),
                     model="ebc-under-dense", reshard_to=after)]
    if world_size < 3:
        return tuple(cases)
    several = {"t0": ("column_wise", (0, 1, 0)), "t1": ("table_wise", 0), "t2": ("column_wise", (1, 2))}
    moved = {"t0": ("column_wise", (2, 0, 1)), "t1": ("table_wise", 2), "t2": ("column_wise", (2, 0))}
    tables, steps = _tables(SPLIT_WIDTH), _steps(world_size)
    for seed, optimizer in ((61, "adagrad"), (62, "rowwise_adagrad")):
        cases.append(DmpCase("reshard-several-shards", _ebc(world_size, several, seed, optimizer, tables=tables, steps=steps),
                             DmpOptions(), model="ebc-under-dense", reshard_to=moved))
    cases.append(DmpCase("reshard-split", _ebc(world_size, split_before(), 63, "sgd", tables=tables, steps=steps),
                         DmpOptions(), model="ebc-under-dense", reshard_to=split_after()))
    return tuple(cases)


def reshards_beyond_two_ranks(world_size: int) -> tuple[DmpCase, ...]:
    """The cases that need three ranks or more (none below)."""
    return tuple(case for case in reshard_cases(world_size) if case.name != "reshard-rowwise") if world_size >= 3 else ()


def split_before() -> dict[str, tuple]:
    """2 column blocks of t0 (ranks 0, 1) and 3 of t1 ([0, 1, 0]) before the move."""
    return {"t0": ("column_wise", (0, 1)), "t1": ("column_wise", (0, 1, 0)), "t2": ("table_wise", 0)}


def split_after() -> dict[str, tuple]:
    """t0 in 3 blocks on [1, 2, 0]: rank 0's block goes to ranks 1 and 2 (its columns 8..12 at offset 8),
    rank 1's to ranks 2 and 0; rank 2 receives two pieces into one shard. No rank sends to itself."""
    return {"t0": ("column_wise", (1, 2, 0)), "t1": ("column_wise", (2, 0, 1)), "t2": ("table_wise", 2)}
