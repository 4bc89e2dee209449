"""Hypothesis draws of checkpoint round trips over what the sharding check draws.

One EBC or EC with 1-3 tables (several features, features shared between tables), each table placed
any way its sharder implements (EBC: TW, RW, CW and TWCW with shards on ranks in any order and
repeated, TWRW, GRID, DP; EC: TW, RW, CW), fused or dense kernels (EBC), fused SGD, Adagrad or
row-wise Adagrad and a dense optimizer (SGD, Adagrad, Adam); saved after 1-2 steps on one of the
world sizes asked for, reloaded into another placement of every table (each keeps its kind: fused,
dense kernel, data-parallel) on any of those world sizes, then 1-2 more steps; checkpointed through
torch.distributed.checkpoint or per rank, with one CombinedOptimizer or two, with the optimizers'
param groups saved or not.

Combinations known to fail (known_broken.py) are repaired out of the draws; the sharding check's own
known failures (MEAN beside row-wise tables, uneven batches on row-wise tables, row shards without
rows, EC with DP or dense tables, variable batches) are never drawn: SUM pooling, one batch size per
step on every rank, rows for every rank, EC fused only.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from paritykit.checks.checkpoint.cases import CheckpointCase, Steps
from paritykit.checks.checkpoint.known_broken import repair
from paritykit.engine.checkpoint import CheckpointRecipe
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.plans import ROW_WISE_FAMILY, local_world_size
from paritykit.harness.tables import TableSpec

EBC_PLACEMENTS = ("table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "grid_shard", "data_parallel")
EC_PLACEMENTS = ("table_wise", "row_wise", "column_wise")
# Placements whose generator takes a kernel: where a dense-kernel table may go.
DENSE_KERNEL_PLACEMENTS = ("table_wise", "row_wise", "column_wise", "table_column_wise")
# Placements whose torchrec code depends on the hosts (intra- and cross-host process groups).
BY_HOST = ("table_row_wise", "grid_shard")
FUSED_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")
SHARD_WIDTH = 4  # torchrec cuts column-wise shards in multiples of 4 columns
MAX_IDS_PER_ROW = 3


def _placement(draw: Any, kind: str, hosts: HostLayout, shards: int) -> tuple:
    """One table's placement on ``hosts``; ``shards``: its column shards (CW, TWCW) or blocks (GRID)."""
    if kind == "table_column_wise":  # one host's ranks
        on_host = hosts.ranks_of_host(draw(st.integers(0, hosts.hosts - 1)))
        return (kind, tuple(draw(st.lists(st.sampled_from(on_host), min_size=shards, max_size=shards))))
    if kind == "column_wise":  # any ranks: across hosts when there are several
        return (kind, tuple(draw(st.lists(st.integers(0, hosts.world_size - 1), min_size=shards, max_size=shards))))
    if kind == "table_wise":
        return (kind, draw(st.integers(0, hosts.world_size - 1)))
    if kind == "table_row_wise":  # the rows over one host's ranks
        return (kind, draw(st.integers(0, hosts.hosts - 1)))
    if kind == "grid_shard":  # column block i on host indexes[i], hosts in any order and repeated
        return (kind, tuple(draw(st.lists(st.integers(0, hosts.hosts - 1), min_size=shards, max_size=shards))))
    return (kind,)


def _kinds(module: str, kernel: str, replicated: bool, device_kinds: dict[str, tuple[str, ...]]) -> list[str]:
    if replicated:
        return ["data_parallel"]
    allowed = DENSE_KERNEL_PLACEMENTS if kernel == "dense" else device_kinds[module]
    return [k for k in allowed if k in device_kinds[module] and k != "data_parallel"]


def _shard_counts(dim: int, module: str, kind: str = "column_wise") -> list[int]:
    """Column shards (CW, TWCW) or blocks (GRID) a table of width ``dim`` can be cut into. An EC's CW
    tables need one shard width: its tables share a width and always 2 or 3 shards. torchrec cuts a
    grid into blocks of MIN_CW_DIM columns (its planner's constant), one host index per block."""
    if kind == "grid_shard":
        return [-(-dim // min_cw_dim())]
    return [n for n in ((2, 3) if module == "ec" else (1, 2, 3)) if dim % (n * SHARD_WIDTH) == 0]


def min_cw_dim() -> int:
    from torchrec.distributed.planner.constants import MIN_CW_DIM

    return MIN_CW_DIM


def _plans(draw: Any, module: str, tables: tuple[TableSpec, ...], kernels: dict[str, str], replicated: set[str],
           layouts: tuple[HostLayout, HostLayout], device_kinds: dict[str, tuple[str, ...]]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The saved plan on layouts[0] and the reload plan on layouts[1]; an EC (whose tables share one
    width) cuts every CW table of a plan into the same number of shards. On several hosts the first
    table of each plan is placed by host (TWRW or GRID) when its kernel allows."""
    plans = []
    for hosts in layouts:
        ec_shards = draw(st.sampled_from(_shard_counts(tables[0].embedding_dim, module)))
        plan = {}
        for index, table in enumerate(tables):
            kinds = _kinds(module, kernels[table.name], table.name in replicated, device_kinds)
            by_host = [k for k in BY_HOST if k in kinds] if hosts.hosts > 1 and index == 0 else []
            kind = draw(st.sampled_from(by_host or kinds))
            shards = ec_shards if module == "ec" and kind == "column_wise" else \
                draw(st.sampled_from(_shard_counts(table.embedding_dim, module, kind)))
            plan[table.name] = _placement(draw, kind, hosts, shards)
        plans.append(plan)
    return plans[0], plans[1]


def _rows(draw: Any, count: int, bound: int) -> tuple[tuple[int, ...], ...]:
    row = st.lists(st.integers(0, bound - 1), max_size=MAX_IDS_PER_ROW).map(tuple)
    return tuple(draw(row) for _ in range(count))


def _steps(draw: Any, keys: list[str], bounds: dict[str, int], world_size: int, count: int) -> Steps:
    # One batch size per step on every rank: row-wise tables cannot take uneven ones on gloo.
    steps = []
    for _ in range(count):
        size = draw(st.integers(1, 3))
        steps.append(tuple(tuple((key, _rows(draw, size, bounds[key])) for key in keys) for _ in range(world_size)))
    return tuple(steps)


def _tables(draw: Any, module: str, count: int, dim: int, hosts: HostLayout) -> tuple[TableSpec, ...]:
    """On several hosts the first table is sometimes as wide as a grid of one block per host."""
    tables = []
    for index in range(count):
        names = [f"f{index}"] + ([f"f{draw(st.integers(0, index - 1))}"] if index and draw(st.booleans()) else [])
        widths = (4, 8, 12) + ((hosts.hosts * min_cw_dim(),) if index == 0 and hosts.hosts > 1 else ())
        tables.append(TableSpec(f"t{index}", draw(st.integers(4, 12)), dim if module == "ec" else draw(st.sampled_from(widths)),
                                tuple(dict.fromkeys(names))))
    return tuple(tables)


def _rows_for_every_rank(tables: tuple[TableSpec, ...], plans: tuple[dict, dict], sizes: tuple[int, int]) -> tuple[TableSpec, ...]:
    """Row-sharded tables grown to a multiple of both world sizes: no rank gets an empty row shard."""
    unit = math.lcm(*sizes)
    grown = []
    for table in tables:
        row_sharded = any(plan[table.name][0] in ROW_WISE_FAMILY for plan in plans)
        rows = unit * -(-max(table.num_embeddings, unit) // unit) if row_sharded else table.num_embeddings
        grown.append(TableSpec(table.name, rows, table.embedding_dim, table.feature_names, table.pooling))
    return tuple(grown)


@st.composite
def checkpoint_cases(draw: Any, world_sizes: tuple[int, ...], device_kinds: dict[str, tuple[str, ...]],
                     hosts: HostLayout | None = None) -> CheckpointCase:
    """A checkpoint case saved on one of ``world_sizes`` (one host each) and reloaded on one of them;
    with ``hosts`` (several), an EBC saved and reloaded on those hosts, the first table placed by host."""
    module = "ebc" if hosts is not None else draw(st.sampled_from(("ebc", "ec")))
    sizes = (hosts.world_size,) * 2 if hosts is not None else (draw(st.sampled_from(world_sizes)), draw(st.sampled_from(world_sizes)))
    layouts = (hosts, hosts) if hosts is not None else (host_layout(sizes[0], local_world_size(sizes[0])),
                                                       host_layout(sizes[1], local_world_size(sizes[1])))
    tables = _tables(draw, module, draw(st.integers(1, 3)), draw(st.sampled_from((8, 12))), layouts[0])
    kernels = {t.name: "fused" if module == "ec" else draw(st.sampled_from(("fused", "fused", "dense"))) for t in tables}
    replicated = {t.name for t in tables if module == "ebc" and kernels[t.name] == "dense" and draw(st.booleans())}
    plan, reload_plan = _plans(draw, module, tables, kernels, replicated, layouts, device_kinds)
    tables = _rows_for_every_rank(tables, (plan, reload_plan), sizes)
    bounds: dict[str, int] = {}
    for table in tables:
        for feature in table.feature_names:
            bounds[feature] = min(bounds.get(feature, table.num_embeddings), table.num_embeddings)
    keys = list(draw(st.permutations(list(bounds))))
    save_after, after = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    same_size = sizes[0] == sizes[1]
    method = draw(st.sampled_from(("dcp", "dcp", "per_rank"))) if same_size else "dcp"
    optimizer = draw(st.sampled_from(FUSED_OPTIMIZERS))
    case = CheckpointCase(
        module=module, tables=tables, plan=plan, reload_plan=plan if method == "per_rank" else reload_plan,
        world_size=sizes[0], reload_world_size=sizes[1],
        steps=_steps(draw, keys, bounds, sizes[0], save_after + (after if same_size else 0)), save_after=save_after,
        reload_steps=None if same_size else _steps(draw, keys, bounds, sizes[1], after),
        kernels={t: k for t, k in kernels.items() if t not in replicated}, optimizer=optimizer,
        dense_optimizer=draw(st.sampled_from(DENSE_OPTIMIZERS)),
        recipe=CheckpointRecipe(method=method, combined=draw(st.booleans()), param_groups=draw(st.booleans())),
        seed=draw(st.integers(0, 2**16)), ranks_per_host=None if hosts is None else hosts.ranks_per_host,
    )
    return repair(case)
