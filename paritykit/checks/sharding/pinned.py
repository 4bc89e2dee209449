"""Cases every run covers before the random draws: the placements where stitching order, pooling,
weights under a feature permutation, variable batches and the optimizers' semantics show, which a
few random draws may miss; and on ranks standing for several hosts, the placements that cross hosts."""

from __future__ import annotations

import dataclasses

from paritykit.checks.sharding.cases import RankBatch, ShardingCase
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.plans import with_rows_for_every_rank
from paritykit.harness.tables import TableSpec

_IDS = (
    (("f0", ((1, 2), (), (3,))), ("f1", ((), (), ())), ("f2", ((0,), (7, 7), ()))),
    (("f0", ((4,), (5, 6), ())), ("f1", ((1,), (), (2, 3))), ("f2", ((), (), (5,)))),
    (("f0", ((7,), (0, 0, 1), (2,))), ("f1", ((3, 3), (4,), ())), ("f2", ((1,), (), (6,)))),
)


def _steps(world_size: int, keys: tuple[str, ...] = ("f0", "f1", "f2"), weighted: bool = False, steps: int = 3):
    def batch(index: int) -> RankBatch:
        ids = tuple(sorted(_IDS[index % len(_IDS)], key=lambda item: keys.index(item[0])))
        weights = tuple((k, tuple(tuple(0.5 + 0.25 * i for i in range(len(r))) for r in rows)) for k, rows in ids) if weighted else None
        return RankBatch(ids, weights)

    return tuple(tuple(batch(rank + step) for rank in range(world_size)) for step in range(steps))


def _vbe_steps(world_size: int, steps: int = 3):
    # Each feature's own distinct rows, which every rank's 3 output rows map onto differently. Two
    # distinct rows per feature: a wrong feature's inverse indices stay in range (and silent).
    def batch(index: int) -> RankBatch:
        ids = (("f0", ((1,), (2, 3))), ("f1", ((4, 5, 6), ())), ("f2", ((), (7, index % 8))))
        inverse = (("f0", (1, 0, 1)), ("f1", (0, 0, 1)), ("f2", ((index % 2), 1, 1)))
        return RankBatch(ids, None, inverse)

    return tuple(tuple(batch(rank + step) for rank in range(world_size)) for step in range(steps))


# Widths of two tables' column shards (12 and 16 columns), shard i on rank i, per world size (3: three or more).
_UNEVEN_WIDTHS = {1: ((12,), (16,)), 2: ((8, 4), (4, 12)), 3: ((8, 4), (4, 8, 4))}


def pinned_cases(world_size: int, ranks_per_host: int | None = None) -> tuple[ShardingCase, ...]:
    """The one-host cases, or on several hosts (``ranks_per_host``) the cross-host ones."""
    if ranks_per_host is not None and ranks_per_host < world_size:
        return cross_host_cases(host_layout(world_size, ranks_per_host))
    last = world_size - 1
    ec_tables = (TableSpec("t0", 10, 12, ("f0",)), TableSpec("t1", 8, 12, ("f1", "f0")), TableSpec("t2", 8, 12, ("f2",)))
    mean = (TableSpec("t0", 10, 8, ("f0",), "MEAN"), TableSpec("t1", 8, 12, ("f1", "f2"), "MEAN"), TableSpec("t2", 8, 8, ("f2",)))
    sums = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2")), TableSpec("t2", 8, 8, ("f2",)))
    return (
        # The seed commit's example: CW shards on ranks [0, 1, 0] (torchrec must permute [0, 2, 1]).
        ShardingCase("ec", world_size, ec_tables, {"t0": ("column_wise", (0, last, 0)), "t1": ("table_wise", last),
                     "t2": ("row_wise",)}, need_indices=True, steps=_steps(world_size), seed=5),
        # A 3-cycle: an inverted permutation differs from it. Adagrad on the shards.
        ShardingCase("ec", world_size, ec_tables, {"t0": ("column_wise", (last, 0, 0)), "t1": ("table_wise", 0),
                     "t2": ("column_wise", (0, 0, last))}, optimizer="adagrad", steps=_steps(world_size), seed=6),
        # MEAN pooling beside CW, TWCW and TW; row-wise Adagrad keeps one accumulator per column shard.
        ShardingCase("ebc", world_size, mean, {"t0": ("column_wise", (last, 0)), "t1": ("table_column_wise", (0, last, 0)),
                     "t2": ("table_wise", 0)}, optimizer="rowwise_adagrad", steps=_steps(world_size), seed=7),
        # Row-wise and table-row-wise MEAN on their own (their divisor path); GRID with SUM.
        ShardingCase("ebc", world_size, sums, {"t0": ("grid_shard", (0,)), "t1": ("grid_shard", (0,)), "t2": ("row_wise",)},
                     optimizer="adagrad", steps=_steps(world_size), seed=11),
        ShardingCase("ebc", world_size, (TableSpec("t0", 10, 8, ("f0",), "MEAN"), TableSpec("t1", 8, 8, ("f1", "f2"), "MEAN")),
                     {"t0": ("row_wise",), "t1": ("table_row_wise", 0)}, steps=_steps(world_size), seed=8),
        # Weighted features, the KJT's keys in another order than the tables', dense kernels and a DP table.
        ShardingCase("ebc", world_size, sums, {"t0": ("row_wise",), "t1": ("column_wise", (last, 0)), "t2": ("data_parallel",)},
                     weighted=True, kernels={"t0": "dense", "t1": "fused"}, dense_optimizer="adagrad",
                     steps=_steps(world_size, keys=("f2", "f0", "f1"), weighted=True), seed=9),
        # A variable batch per feature with inverse indices over RW, CW and TWCW.
        ShardingCase("ebc", world_size, sums, {"t0": ("row_wise",), "t1": ("column_wise", (0, last)), "t2": ("table_column_wise", (last, 0))},
                     optimizer="rowwise_adagrad", steps=_vbe_steps(world_size), seed=10),
        # Column shards of unequal widths (column_wise(size_per_rank=...)), MEAN beside SUM, beside equal-width
        # CW shards; row-wise Adagrad keeps one accumulator per shard row.
        ShardingCase("ebc", world_size, (TableSpec("t0", 10, 12, ("f0",)), TableSpec("t1", 8, 16, ("f1", "f2"), "MEAN"),
                                         TableSpec("t2", 8, 8, ("f2",))),
                     {"t0": ("column_wise_sized", _UNEVEN_WIDTHS[min(world_size, 3)][0]),
                      "t1": ("column_wise_sized", _UNEVEN_WIDTHS[min(world_size, 3)][1]), "t2": ("column_wise", (last, 0))},
                     optimizer="rowwise_adagrad", steps=_steps(world_size), seed=13),
    ) + ((
        # A variable batch over row-wise MEAN tables alone: the MEAN divisor of a variable batch is expanded
        # by the inverse indices (embeddingbag's mean-pooling callback). One placement kind: a plan that
        # reorders the features is the known issue vbe-row-mean-reordered. From two ranks (gate time).
        ShardingCase("ebc", world_size, tuple(dataclasses.replace(t, pooling="MEAN") for t in sums),
                     {"t0": ("row_wise",), "t1": ("row_wise",), "t2": ("row_wise",)}, steps=_vbe_steps(world_size), seed=12),
    ) if world_size > 1 else ())


def cross_host_cases(hosts: HostLayout) -> tuple[ShardingCase, ...]:
    """Placements whose code depends on the hosts: TWRW on several hosts with a different number of
    features on each (the input's staggered shuffle, the intra-host reduce-scatter then the cross-host
    all-to-all), GRID with its host indexes reversed and repeated, CW and TWCW across and on hosts, a
    variable batch over TWRW, and an EC's CW shards in a 3-cycle across hosts."""
    ws, rph, last_host = hosts.world_size, hosts.ranks_per_host, hosts.hosts - 1
    last, first_of_last_host = ws - 1, hosts.ranks_of_host(last_host)[0]
    steps = _steps(ws)
    from torchrec.distributed.planner.constants import MIN_CW_DIM

    twrw = (TableSpec("t0", 12, 8, ("f0", "f1")), TableSpec("t1", 8, 12, ("f2",)), TableSpec("t2", 8, 8, ("f1",)))
    grid = (TableSpec("t0", 12, 2 * MIN_CW_DIM, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2")), TableSpec("t2", 8, 12, ("f2",)))
    two_blocks = (TableSpec("t0", 8, 2 * MIN_CW_DIM, ("f0",)), TableSpec("t1", 12, 8, ("f1",), "MEAN"), TableSpec("t2", 8, 8, ("f2",)))
    sums = (TableSpec("t0", 8, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2")), TableSpec("t2", 8, 8, ("f2",)))
    ec_tables = (TableSpec("t0", 10, 12, ("f0",)), TableSpec("t1", 8, 12, ("f1", "f0")), TableSpec("t2", 8, 12, ("f2",)))
    cases = (
        # Two TWRW tables (three features) on the last host, one on the first, TW on the last rank.
        ShardingCase("ebc", ws, twrw, {"t0": ("table_row_wise", last_host), "t1": ("table_row_wise", 0),
                     "t2": ("table_row_wise", last_host)}, optimizer="adagrad", steps=steps, seed=31, ranks_per_host=rph),
        # GRID's column blocks on hosts in reverse order, beside TWRW and CW shards across hosts.
        ShardingCase("ebc", ws, grid, {"t0": ("grid_shard", (last_host, 0)), "t1": ("table_row_wise", last_host),
                     "t2": ("column_wise", (last, 0, first_of_last_host))}, optimizer="rowwise_adagrad", steps=steps, seed=32,
                     ranks_per_host=rph),
        # Both blocks of one GRID table on the last host; TWCW on the last host's ranks (a dense kernel);
        # a MEAN table table-wise there.
        ShardingCase("ebc", ws, two_blocks, {"t0": ("grid_shard", (last_host, last_host)), "t1": ("table_wise", first_of_last_host),
                     "t2": ("table_column_wise", (last, first_of_last_host))}, kernels={"t2": "dense"}, steps=steps, seed=33,
                     ranks_per_host=rph),
        # Weighted ids through TWRW on the last host beside RW and a DP table; the KJT's keys reordered.
        ShardingCase("ebc", ws, sums, {"t0": ("table_row_wise", last_host), "t1": ("row_wise",), "t2": ("data_parallel",)},
                     weighted=True, dense_optimizer="adagrad", steps=_steps(ws, keys=("f2", "f0", "f1"), weighted=True), seed=34,
                     ranks_per_host=rph),
        # A variable batch per feature through TWRW on two hosts (its per-host batch bookkeeping).
        ShardingCase("ebc", ws, sums, {"t0": ("table_row_wise", last_host), "t1": ("table_row_wise", 0),
                     "t2": ("column_wise", (last, 0))}, optimizer="rowwise_adagrad", steps=_vbe_steps(ws), seed=35,
                     ranks_per_host=rph),
        # An EC's CW shards in a 3-cycle across hosts (torchrec must permute them back).
        ShardingCase("ec", ws, ec_tables, {"t0": ("column_wise", (last, 0, first_of_last_host)), "t1": ("table_wise", first_of_last_host),
                     "t2": ("row_wise",)}, need_indices=True, steps=steps, seed=36, ranks_per_host=rph),
    )
    # Every rank a row of every row-sharded table, however many hosts (an empty shard is a known fbgemm CPU issue).
    return tuple(dataclasses.replace(case, tables=with_rows_for_every_rank(case.tables, case.plan, ws)) for case in cases)
