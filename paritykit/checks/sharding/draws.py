"""Hypothesis draws of sharding cases over the whole matrix torchrec offers.

One module per case (EBC or EC) with 1-4 tables, several features per table and features shared
between tables, each table placed any way its sharder implements (EBC: TW, RW, CW and TWCW with
shards on ranks in any order and repeated, CW shards of unequal widths, TWRW, GRID, DP; EC: TW, RW,
CW, DP), fused or dense
kernels, SUM and MEAN pooling in one module, per-id weights (EBC), ``need_indices`` (EC), a
variable batch per feature with inverse indices (VBE, EBC), the KJT's keys in any order, empty rows
and empty features, and several training steps with a fused and a dense optimizer whose
hyper-parameters are drawn too (optimizer_draws.py).

On ranks that stand for several hosts (``ranks_per_host``) every case is an EBC with at least one
table placed by host (TWRW on any host, or GRID with one column block per host index in any order,
repeats included: the code that builds and uses torchrec's intra- and cross-host process groups),
beside TWCW on any one host's ranks, CW shards on ranks across hosts, TW, RW and DP. (An EC has no
placement by host: its CW shards across hosts are drawn on one host's pools as well.)

Combinations that fail inside torchrec are kept out of the draws by ``BrokenCombination`` rules
(known_broken.py) and run on purpose as their own cases instead.
"""

from __future__ import annotations

from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from paritykit.checks.sharding.cases import RankBatch, ShardingCase
from paritykit.checks.sharding.known_broken import repair
from paritykit.checks.sharding.optimizer_draws import dense_optimizers, embedding_optimizers
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.plans import ROW_WISE_FAMILY
from paritykit.harness.tables import TableSpec

# column_wise_sized: column shards of drawn, unequal widths, shard i on rank i (column_wise(size_per_rank=...)).
EBC_PLACEMENTS = ("table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "grid_shard", "data_parallel",
                  "column_wise_sized")
EC_PLACEMENTS = ("table_wise", "row_wise", "column_wise", "data_parallel")
# Placements whose torchrec code depends on the hosts (intra- and cross-host process groups).
BY_HOST = ("table_row_wise", "grid_shard")
SHARD_WIDTHS = (4, 8)
SIZED_SHARD_WIDTHS = (4, 8, 12)
SHARD_COUNTS = (1, 2, 3, 4)
MAX_IDS_PER_ROW = 3


def _placement(draw: Any, kind: str, hosts: HostLayout, shards: int) -> tuple:
    """One table's placement; ``shards``: its column shards (CW, TWCW) or column blocks (GRID)."""
    rank, host = st.integers(0, hosts.world_size - 1), st.integers(0, hosts.hosts - 1)
    if kind == "table_column_wise":  # TWCW shards stay on one host, any host's ranks
        on_host = st.sampled_from(hosts.ranks_of_host(draw(host)))
        return (kind, tuple(draw(st.lists(on_host, min_size=shards, max_size=shards))))
    if kind == "column_wise":  # any ranks: across hosts when there are several
        return (kind, tuple(draw(st.lists(rank, min_size=shards, max_size=shards))))
    if kind == "table_wise":
        return (kind, draw(rank))
    if kind == "table_row_wise":  # the rows over that host's ranks
        return (kind, draw(host))
    if kind == "grid_shard":  # column block i on host indexes[i]: the rows over that host's ranks
        if shards > 1 and draw(st.booleans()):  # each block on its own host, the hosts in any order
            return (kind, tuple(draw(st.permutations(range(hosts.hosts)))[:shards]))
        return (kind, tuple(draw(st.lists(host, min_size=shards, max_size=shards))))
    return (kind,)


def _shape(draw: Any, kind: str, hosts: HostLayout) -> tuple[int, int]:
    """(column shards or grid blocks, embedding dim) of an EBC table placed ``kind``. torchrec's
    grid_shard cuts columns into blocks of MIN_CW_DIM (its planner's constant), so a grid of several
    blocks is that wide per block; on one host a grid has one block."""
    if kind != "grid_shard":
        shards = draw(st.sampled_from(SHARD_COUNTS))
        return shards, shards * draw(st.sampled_from(SHARD_WIDTHS))
    blocks = draw(st.integers(1, hosts.hosts))
    if blocks == 1:
        return 1, draw(st.sampled_from(SHARD_COUNTS)) * draw(st.sampled_from(SHARD_WIDTHS))
    from torchrec.distributed.planner.constants import MIN_CW_DIM

    return blocks, blocks * MIN_CW_DIM


def _column_widths(draw: Any, hosts: HostLayout) -> tuple[int, ...]:
    """column_wise_sized's widths: one shard per rank from rank 0, at most one per rank."""
    return tuple(draw(st.lists(st.sampled_from(SIZED_SHARD_WIDTHS), min_size=1, max_size=min(hosts.world_size, max(SHARD_COUNTS)))))


def _draw_tables(draw: Any, module: str, hosts: HostLayout, device_kinds: tuple[str, ...]):
    count = draw(st.integers(1, 4))
    by_host = tuple(k for k in BY_HOST if k in device_kinds) if hosts.hosts > 1 else ()
    ec_shards, ec_width = draw(st.sampled_from(SHARD_COUNTS)), draw(st.sampled_from(SHARD_WIDTHS))
    weighted = module == "ebc" and draw(st.booleans())
    features = [f"f{i}" for i in range(count)]
    tables, plan, kernels = [], {}, {}
    for index in range(count):
        kind = draw(st.sampled_from(by_host if index == 0 and by_host else device_kinds))
        widths = _column_widths(draw, hosts) if kind == "column_wise_sized" else ()
        if module == "ec":
            shards, dim = ec_shards, ec_shards * ec_width
        elif widths:
            shards, dim = len(widths), sum(widths)
        else:
            shards, dim = _shape(draw, kind, hosts)
        names = [features[index]] + ([features[draw(st.integers(0, index - 1))]] if index and draw(st.booleans()) else [])
        tables.append(TableSpec(
            name=f"t{index}", num_embeddings=draw(st.integers(4, 12)), embedding_dim=dim,
            feature_names=tuple(dict.fromkeys(names)),
            pooling="SUM" if module == "ec" or weighted else draw(st.sampled_from(("SUM", "MEAN"))),
        ))
        plan[f"t{index}"] = ("column_wise_sized", widths) if widths else _placement(draw, kind, hosts, shards)
        kernels[f"t{index}"] = "fused" if module == "ec" else draw(st.sampled_from(("fused", "dense")))
    return tables, plan, kernels, weighted


def _rows(draw: Any, count: int, bound: int) -> tuple[tuple[int, ...], ...]:
    # Empty rows are frequent on purpose; an all-empty feature comes from every row being empty.
    if draw(st.integers(0, 5)) == 0:
        return tuple(() for _ in range(count))
    row = st.lists(st.integers(0, bound - 1), max_size=MAX_IDS_PER_ROW).map(tuple)
    return tuple(draw(row) for _ in range(count))


def _rank_batch(draw: Any, keys: list[str], bounds: dict[str, int], weighted: bool, vbe: bool, batch_size: int,
                sizes: dict[str, int] | None = None) -> RankBatch:
    sizes = sizes or {key: draw(st.integers(1, 3)) if vbe else batch_size for key in keys}
    ids = tuple((key, _rows(draw, sizes[key], bounds[key])) for key in keys)
    weights = None
    if weighted:
        weights = tuple((key, tuple(tuple(0.25 + ((i + r) % 4) * 0.5 for i in range(len(row))) for r, row in enumerate(rows)))
                        for key, rows in ids)
    inverse = None
    if vbe:
        inverse = tuple((key, tuple(draw(st.lists(st.integers(0, sizes[key] - 1), min_size=batch_size, max_size=batch_size))))
                        for key in keys)
    return RankBatch(ids, weights, inverse)


@st.composite
def sharding_cases(draw: Any, world_size: int, device_kinds: dict[str, tuple[str, ...]], steps: int = 3,
                   ranks_per_host: int | None = None) -> ShardingCase:
    """A ShardingCase at ``world_size`` (hosts of ``ranks_per_host`` ranks; None: one host);
    ``device_kinds[module]`` the placements to draw from."""
    hosts = host_layout(world_size, ranks_per_host)
    module = "ebc" if hosts.hosts > 1 else draw(st.sampled_from(("ebc", "ec")))
    tables, plan, kernels, weighted = _draw_tables(draw, module, hosts, device_kinds[module])
    bounds: dict[str, int] = {}
    for table in tables:
        for feature in table.feature_names:
            bounds[feature] = min(bounds.get(feature, table.num_embeddings), table.num_embeddings)
    keys = list(draw(st.permutations(list(bounds))))  # the KJT's key order need not be the tables'
    vbe = module == "ebc" and draw(st.integers(0, 3)) == 0
    # Ranks may have different batch sizes, except where the row-wise family cannot take it (known_broken.py).
    uneven = not any(entry[0] in ROW_WISE_FAMILY for entry in plan.values()) and draw(st.booleans())
    batches = []
    for _ in range(steps):
        shared = draw(st.integers(1, 3))
        # A variable batch's rows per feature too are the same on every rank unless uneven.
        per_feature = None if uneven or not vbe else {key: draw(st.integers(1, 3)) for key in keys}
        sizes = [draw(st.integers(1, 3)) if uneven else shared for _ in range(world_size)]
        batches.append(tuple(_rank_batch(draw, keys, bounds, weighted, vbe, size, per_feature) for size in sizes))
    batches = tuple(batches)
    case = ShardingCase(
        module=module, world_size=world_size, tables=tuple(tables), plan=plan, kernels=kernels,
        need_indices=module == "ec" and draw(st.booleans()), weighted=weighted,
        optimizer=draw(embedding_optimizers(vbe)), dense_optimizer=draw(dense_optimizers()),
        steps=batches, seed=draw(st.integers(0, 2**16)), ranks_per_host=ranks_per_host,
    )
    case = repair(case)
    # A repair may take the table placed by host away (GRID with a variable batch, on stacks where that fails).
    assume(hosts.hosts == 1 or any(entry[0] in BY_HOST for entry in case.plan.values()))
    return case
