"""Round trips every run covers before the random draws, and one case per known-broken rule.

Pinned (``pinned_cases``), for the world size W the gate gives and, where a second world size is
asked for, a reload onto it:
- CW on ranks [0, W-1, 0] reloaded as row-wise, TW reloaded as CW, a DP table under Adam (DCP);
- row-wise Adagrad across a column-wise reshard that keeps the column blocks but moves them between
  ranks ([0, W-1, 0] -> [W-1, 0, 0], TWCW -> CW, GRID -> TWRW): each block's accumulators must follow
  their columns;
- per-rank torch.save on the same plan (the path where the optimizers' own load_state_dict copies
  the state): row-wise Adagrad with CW shards on [0, W-1, 0], a dense-kernel table under Adagrad,
  one CombinedOptimizer, its param groups saved too;
- a warm-up schedule on the dense optimizer (its iteration and learning rate must survive);
- fused SGD through DCP on a plan where every rank holds every table;
- an EC saved on W ranks and reloaded on another world size (both ways).

On ranks that stand for several hosts (``cross_host_cases``): a grid of one column block per host in
reverse host order, reloaded with the blocks swapped between the hosts, beside table-row-wise on the
last host and column-wise shards across hosts, under row-wise Adagrad (whose state torchrec lays out
block after block for a grid: the offsets the reload must find); and under Adagrad a grid of two
blocks on one host and table-column-wise shards on the last host, moved elsewhere.
"""

from __future__ import annotations

from paritykit.checks.checkpoint.cases import CheckpointCase, Steps
from paritykit.engine.checkpoint import CheckpointRecipe
from paritykit.harness.hosts import HostLayout
from paritykit.harness.tables import TableSpec

_ROWS = (
    (("f0", ((1, 2), (), (3,))), ("f1", ((), (4,), (2, 7))), ("f2", ((0,), (5, 5), ()))),
    (("f0", ((4,), (5, 6), ())), ("f1", ((1,), (), (3,))), ("f2", ((), (1,), (6,)))),
    (("f0", ((7,), (0, 0, 1), (2,))), ("f1", ((3, 3), (6,), ())), ("f2", ((2,), (), (7, 4)))),
)
# Three features read by three tables of 8 rows (the row-sharded ones grown to a multiple of W).
WARMUP = (("linear", 4, 0.5),)


def steps(world_size: int, count: int, offset: int = 0, keys: tuple[str, ...] = ("f0", "f1", "f2")) -> Steps:
    """``count`` steps of ``world_size`` rank batches (three rows per feature; ids below 8)."""
    def batch(index: int):
        return tuple(item for item in _ROWS[index % len(_ROWS)] if item[0] in keys)

    return tuple(tuple(batch(offset + step + rank) for rank in range(world_size)) for step in range(count))


def _tables(width: int, rows: int, count: int = 3) -> tuple[TableSpec, ...]:
    return tuple(TableSpec(f"t{i}", rows, width, (f"f{i}",)) for i in range(count))


def _rows(world_size: int, other: int = 1) -> int:
    return max(8, 4 * world_size * other)


def pinned_cases(world_size: int, other: int | None = None) -> tuple[CheckpointCase, ...]:
    """The pinned cases on ``world_size`` ranks; with ``other``, the EC also reloads onto it."""
    last, rows = world_size - 1, _rows(world_size)
    wide = _tables(12, rows)
    cases = [
        CheckpointCase("ebc", wide, {"t0": ("column_wise", (0, last, 0)), "t1": ("table_wise", last), "t2": ("data_parallel",)},
                       {"t0": ("row_wise",), "t1": ("column_wise", (last, 0, last)), "t2": ("data_parallel",)},
                       world_size, world_size, steps(world_size, 4), save_after=2, optimizer="adagrad", dense_optimizer="adam",
                       seed=31),
        CheckpointCase("ebc", wide, {"t0": ("column_wise", (0, last, 0)), "t1": ("table_column_wise", (0, last, 0)),
                                     "t2": ("grid_shard", (0,))},
                       {"t0": ("column_wise", (last, 0, 0)), "t1": ("column_wise", (last, last, 0)), "t2": ("table_row_wise", 0)},
                       world_size, world_size, steps(world_size, 4), save_after=2, optimizer="rowwise_adagrad", seed=32),
        CheckpointCase("ebc", wide, {"t0": ("column_wise", (0, last, 0)), "t1": ("row_wise",), "t2": ("data_parallel",)},
                       {"t0": ("column_wise", (0, last, 0)), "t1": ("row_wise",), "t2": ("data_parallel",)},
                       world_size, world_size, steps(world_size, 3), save_after=2, kernels={"t1": "dense"},
                       optimizer="rowwise_adagrad", dense_optimizer="adagrad",
                       recipe=CheckpointRecipe("per_rank", combined=True, param_groups=True),
                       seed=33),
        CheckpointCase("ebc", wide, {"t0": ("row_wise",), "t1": ("table_wise", last), "t2": ("data_parallel",)},
                       {"t0": ("row_wise",), "t1": ("table_wise", last), "t2": ("data_parallel",)},
                       world_size, world_size, steps(world_size, 4), save_after=2, optimizer="adagrad", dense_optimizer="adam",
                       recipe=CheckpointRecipe(warmup=WARMUP), seed=34),
        CheckpointCase("ebc", _tables(8, rows), {"t0": ("row_wise",), "t1": ("grid_shard", (0,)), "t2": ("data_parallel",)},
                       {"t0": ("table_row_wise", 0), "t1": ("row_wise",), "t2": ("data_parallel",)},
                       world_size, world_size, steps(world_size, 3), save_after=1, seed=35),
    ]
    for reload_size in ([] if other is None or other == world_size else [other]):
        cases.append(_ec_elsewhere(world_size, reload_size, seed=36))
        cases.append(_ec_elsewhere(reload_size, world_size, seed=37))
    return tuple(cases)


def cross_host_cases(hosts: HostLayout) -> tuple[CheckpointCase, ...]:
    """Round trips on ``hosts`` (several) whose placements cross hosts; the grid tables are one
    MIN_CW_DIM-wide block per host, as torchrec cuts them."""
    from torchrec.distributed.planner.constants import MIN_CW_DIM

    ws, rph, last_host, last = hosts.world_size, hosts.ranks_per_host, hosts.hosts - 1, hosts.world_size - 1
    rows = _rows(ws)
    blocks = tuple(range(hosts.hosts))
    tables = (TableSpec("t0", rows, hosts.hosts * MIN_CW_DIM, ("f0",)),) + tuple(
        TableSpec(f"t{i}", rows, 12, (f"f{i}",)) for i in (1, 2))
    on_last = hosts.ranks_of_host(last_host)
    return (
        CheckpointCase("ebc", tables, {"t0": ("grid_shard", blocks[::-1]), "t1": ("table_row_wise", last_host),
                                       "t2": ("column_wise", (0, last, rph))},
                       {"t0": ("grid_shard", blocks), "t1": ("row_wise",), "t2": ("table_column_wise", (on_last[-1], on_last[0], on_last[-1]))},
                       ws, ws, steps(ws, 4), save_after=2, optimizer="rowwise_adagrad", dense_optimizer="adam", seed=51,
                       ranks_per_host=rph),
        CheckpointCase("ebc", tables, {"t0": ("grid_shard", (last_host,) * hosts.hosts), "t1": ("table_column_wise", on_last[:1] + on_last),
                                       "t2": ("table_row_wise", 0)},
                       {"t0": ("table_row_wise", 0), "t1": ("column_wise", (last, 0, rph)), "t2": ("grid_shard", (last_host,))},
                       ws, ws, steps(ws, 3), save_after=1, optimizer="adagrad", dense_optimizer="sgd", seed=52,
                       ranks_per_host=rph),
    )


def _ec_elsewhere(saved_on: int, reload_on: int, seed: int) -> CheckpointCase:
    """An EC saved on ``saved_on`` ranks and resumed on ``reload_on``: row-wise Adagrad keeps its blocks."""
    tables = _tables(12, _rows(saved_on, reload_on))
    placed = lambda size: {"t0": ("column_wise", (0, size - 1, 0)), "t1": ("table_wise", size - 1), "t2": ("row_wise",)}
    moved = lambda size: {"t0": ("column_wise", (size - 1, 0, size - 1)), "t1": ("row_wise",), "t2": ("table_wise", 0)}
    return CheckpointCase("ec", tables, placed(saved_on), moved(reload_on), saved_on, reload_on, steps(saved_on, 2),
                          save_after=2, reload_steps=steps(reload_on, 2, offset=1), optimizer="rowwise_adagrad", seed=seed)


def known_broken_cases(world_size: int) -> dict[str, CheckpointCase]:
    """One small case per rule of known_broken.py (rule name -> case), on ``world_size`` >= 2 ranks."""
    last, rows = world_size - 1, _rows(world_size)
    wide, two = _tables(12, rows), _tables(8, rows, 2)
    tw = {"t0": ("table_wise", 0), "t1": ("table_wise", last)}
    cw = {"t0": ("column_wise", (0, last, 0)), "t1": ("row_wise",), "t2": ("data_parallel",)}
    return {
        "dcp-rank-without-a-table-and-empty-optimizer-state": CheckpointCase(
            "ebc", two, tw, tw, world_size, world_size, steps(world_size, 2, keys=("f0", "f1")), save_after=1, seed=41),
        "dcp-dense-kernel-optimizer-state": CheckpointCase(
            "ebc", two, {"t0": ("row_wise",), "t1": ("row_wise",)}, {"t0": ("row_wise",), "t1": ("row_wise",)},
            world_size, world_size, steps(world_size, 2, keys=("f0", "f1")), save_after=1, kernels={"t0": "dense"},
            optimizer="adagrad", dense_optimizer="adagrad", seed=42),
        "dense-kernel-table-missing-on-a-rank": CheckpointCase(
            "ebc", two, {"t0": ("table_wise", last), "t1": ("row_wise",)}, {"t0": ("table_wise", last), "t1": ("row_wise",)},
            world_size, world_size, steps(world_size, 2, keys=("f0", "f1")), save_after=1, kernels={"t0": "dense"},
            optimizer="adagrad", dense_optimizer="adam", recipe=CheckpointRecipe("per_rank"), seed=46),
        "row-wise-state-other-column-blocks": CheckpointCase(
            "ebc", wide, cw, {**cw, "t0": ("row_wise",)}, world_size, world_size, steps(world_size, 3), save_after=2,
            optimizer="rowwise_adagrad", dense_optimizer="adam", seed=43),
        "per-rank-load-other-shards": CheckpointCase(
            "ebc", wide, cw, {**cw, "t0": ("column_wise", (last, 0, 0))}, world_size, world_size, steps(world_size, 3),
            save_after=2, optimizer="adagrad", dense_optimizer="adam", recipe=CheckpointRecipe("per_rank"), seed=44),
        "dcp-param-groups-per-rank": CheckpointCase(
            "ebc", two, tw, {"t0": ("row_wise",), "t1": ("row_wise",)}, world_size, world_size,
            steps(world_size, 2, keys=("f0", "f1")), save_after=1, optimizer="adagrad",
            recipe=CheckpointRecipe(param_groups=True), seed=47),
        "warmup-over-combined-optimizer": CheckpointCase(
            "ebc", wide, cw, cw, world_size, world_size, steps(world_size, 3), save_after=2, optimizer="adagrad",
            dense_optimizer="adam", recipe=CheckpointRecipe(combined=True, warmup=WARMUP), seed=45),
    }
