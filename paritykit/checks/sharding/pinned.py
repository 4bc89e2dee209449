"""Cases every run covers before the random draws: the placements where stitching order, pooling,
weights under a feature permutation, variable batches and the optimizers' semantics show, which a
few random draws may miss."""

from __future__ import annotations

from paritykit.checks.sharding.cases import RankBatch, ShardingCase
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


def pinned_cases(world_size: int) -> tuple[ShardingCase, ...]:
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
    )
