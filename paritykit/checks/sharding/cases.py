"""The cases of the sharding check: drawn plans (``cw_cases``), pinned placements and the
combinations known to fail inside torchrec, each a ``ShardingCase``.

``cw_cases(world_sizes=(2,), modules=("ec", "ebc"), device="cpu")`` draws a ``ShardingCase``:
tables (features shared between tables too), a per-table plan with at least one column-wise
table cut into 2-4 shards on arbitrary ranks (repeats, unsorted) mixed with the other placements,
one compute kernel, ``need_indices`` (EC) or per-id weights (EBC), and one local batch per rank
with empty rows and empty features.

The draws stay inside what torchrec accepts (so examples test parity, not rejections):
- an EmbeddingCollection needs one embedding_dim for all tables, and its column-wise tables one
  shard width, so all its CW tables get the same number of shards;
- ``column_wise(ranks=...)`` only honours a shard width that is a multiple of 4 and divides the dim;
- placements and kernels come from what torchrec's sharder advertises for the module and device,
  minus ``BROKEN_ON_DEVICE`` (combinations that crash or compute wrong numbers in torchrec 1.8;
  they are exercised on purpose by explicit cases, not by random draws).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from paritykit.checks import known_issues
from paritykit.harness import plans
from paritykit.harness.plans import describe_plan
from paritykit.harness.tables import TableSpec

SHARD_WIDTHS = (4, 8)
CW_SHARD_COUNTS = (2, 3, 4)

# (device type, module, placement or kernel) -> why: every combination a known issue names
# (paritykit/checks/known_issues.toml, `draws`), whatever its versions; known_broken_cases runs each.
BROKEN_ON_DEVICE = known_issues.DrawCombinations()


@dataclass(frozen=True)
class ShardingCase:
    """One sharded-vs-unsharded case. Picklable: it travels to every rank."""

    module: str  # "ec" or "ebc"
    world_size: int
    tables: tuple[TableSpec, ...]
    plan: dict[str, tuple] = field(hash=False)
    kernel: str
    need_indices: bool = False
    weighted: bool = False
    # batches[rank][feature] -> rows of ids; weights likewise when weighted.
    batches: tuple[dict[str, tuple[tuple[int, ...], ...]], ...] = field(default=(), hash=False)
    weights: tuple[dict[str, tuple[tuple[float, ...], ...]], ...] | None = field(default=None, hash=False)
    seed: int = 0

    def plan_shape(self) -> str:
        """The plan with table names and ranks left out: what a count of examples is grouped by."""
        kinds = sorted(
            f"{entry[0]}x{len(entry[1])}" if entry[0] == "column_wise" else entry[0] for entry in self.plan.values()
        )
        return f"{self.module}/ws{self.world_size}/{self.kernel}/" + "+".join(kinds)

    def describe(self) -> str:
        tables = ", ".join(
            f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)}"
            + (f" {t.pooling}" if self.module == "ebc" else "")
            + "]"
            for t in self.tables
        )
        flags = f"need_indices={self.need_indices}" if self.module == "ec" else f"weighted={self.weighted}"
        return (
            f"{self.module} world_size={self.world_size} kernel={self.kernel} {flags} "
            f"plan={describe_plan(self.plan)} tables=({tables}) seed={self.seed}"
        )


def supported_on_device(device: str, module: str, name: str) -> bool:
    """False for a (module, sharding type or kernel) combination known to fail inside torchrec on
    ``device`` with the installed versions (a known issue that is not fixed here names it)."""
    return known_issues.kept_out_of_draws(device, module, name) is None


def placements_for(module: str, device: str) -> tuple[str, ...]:
    """The sharding types torchrec offers for ``module`` that a plan can express, minus the broken ones."""
    return tuple(t for t in plans.placements_for(module, device) if supported_on_device(device, module, t))


def kernels_for(module: str, device: str) -> tuple[str, ...]:
    """Kernels for the model-parallel tables of a case (data-parallel tables always use dense)."""
    return tuple(k for k in plans.compute_kernels(device, "column_wise", module) if supported_on_device(device, module, k))


def placement_entry(kind: str, world_size: int, draw: Any, cw_shards: int | None = None) -> tuple:
    if kind == "column_wise":
        assert cw_shards is not None
        return ("column_wise", tuple(draw(st.lists(st.integers(0, world_size - 1), min_size=cw_shards, max_size=cw_shards))))
    if kind == "table_wise":
        return ("table_wise", draw(st.integers(0, world_size - 1)))
    if kind == "table_row_wise":
        return ("table_row_wise", 0)  # one host: every rank is local
    return (kind,)


@st.composite
def rows_strategy(draw: Any, num_embeddings: int, batch_size: int, max_len: int = 3) -> tuple[tuple[int, ...], ...]:
    # Empty rows are frequent on purpose; an all-empty feature comes from every row being empty.
    if draw(st.integers(0, 4)) == 0:
        return tuple(() for _ in range(batch_size))
    row = st.lists(st.integers(0, num_embeddings - 1), min_size=0, max_size=max_len).map(tuple)
    return tuple(draw(row) for _ in range(batch_size))


def _draw_tables_and_plan(draw: Any, module: str, world_size: int, device: str, max_tables: int):
    num_tables = draw(st.integers(1, max_tables))
    kinds = placements_for(module, device)
    placement_kinds = ["column_wise"] + [draw(st.sampled_from(kinds)) for _ in range(num_tables - 1)]
    placement_kinds = draw(st.permutations(placement_kinds))

    # EC: one dim and one shard width for every table, hence one CW shard count.
    ec_shards = draw(st.sampled_from(CW_SHARD_COUNTS))
    ec_width = draw(st.sampled_from(SHARD_WIDTHS))
    # torch's weighted embedding_bag only sums, so a weighted EBC keeps SUM pooling.
    weighted = module == "ebc" and draw(st.booleans())
    own_features = [f"f{i}" for i in range(num_tables)]
    tables, plan = [], {}
    for index, kind in enumerate(placement_kinds):
        name = f"t{index}"
        shards = ec_shards if module == "ec" else draw(st.sampled_from(CW_SHARD_COUNTS))
        width = ec_width if module == "ec" else draw(st.sampled_from(SHARD_WIDTHS))
        features = [own_features[index]]
        # Features shared between tables: a table may also read an earlier table's feature.
        if index > 0 and draw(st.booleans()):
            features.append(own_features[draw(st.integers(0, index - 1))])
        tables.append(
            TableSpec(
                name=name,
                num_embeddings=draw(st.integers(4, 12)),
                embedding_dim=shards * width if (module == "ec" or kind == "column_wise") else draw(st.sampled_from((4, 8, 12))),
                feature_names=tuple(features),
                pooling=draw(st.sampled_from(("SUM", "MEAN"))) if module == "ebc" and not weighted else "SUM",
            )
        )
        plan[name] = placement_entry(kind, world_size, draw, cw_shards=shards)
    return tables, plan, weighted


def _draw_batches(draw: Any, tables: list[TableSpec], world_size: int, weighted: bool):
    batch_size = draw(st.integers(1, 3))
    feature_rows: dict[str, int] = {}
    for table in tables:
        for feature in table.feature_names:
            # A shared feature indexes every table reading it: keep ids inside the smallest.
            feature_rows[feature] = min(feature_rows.get(feature, table.num_embeddings), table.num_embeddings)
    batches, weights = [], []
    for _ in range(world_size):
        batch = {f: draw(rows_strategy(n, batch_size)) for f, n in feature_rows.items()}
        batches.append(batch)
        if weighted:
            weights.append({f: tuple(tuple(float(0.5 + (i % 3)) for i in range(len(r))) for r in rows) for f, rows in batch.items()})
    return tuple(batches), (tuple(weights) if weighted else None)


@st.composite
def cw_cases(
    draw: Any,
    world_sizes: tuple[int, ...] = (2,),
    modules: tuple[str, ...] = ("ec", "ebc"),
    device: str = "cpu",
    max_tables: int = 3,
) -> ShardingCase:
    module = draw(st.sampled_from(modules))
    world_size = draw(st.sampled_from(world_sizes))
    tables, plan, weighted = _draw_tables_and_plan(draw, module, world_size, device, max_tables)
    kernel = draw(st.sampled_from(kernels_for(module, device)))
    need_indices = module == "ec" and draw(st.booleans())
    batches, weights = _draw_batches(draw, tables, world_size, weighted)
    return ShardingCase(
        module=module,
        world_size=world_size,
        tables=tuple(tables),
        plan=plan,
        kernel=kernel,
        need_indices=need_indices,
        weighted=weighted,
        batches=batches,
        weights=weights,
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def shard_rank_placements(draw: Any, max_world_size: int = 4, max_shards: int = 6) -> list[int]:
    """Arbitrary CW shard ranks: repeats and unsorted orders included."""
    world_size = draw(st.integers(1, max_world_size))
    return draw(st.lists(st.integers(0, world_size - 1), min_size=1, max_size=max_shards))


# Two ranks' worth of rows with empty rows and an empty feature; larger worlds repeat them.
_PINNED_BATCHES = (
    {"f0": ((1, 2), (), (3,)), "f1": ((), (), ()), "f2": ((0,), (7, 7), ())},
    {"f0": ((4,), (5, 6), ()), "f1": ((1,), (), (2, 3)), "f2": ((), (), ())},
)


def pinned_cases(world_size: int, device: str) -> tuple[ShardingCase, ...]:
    """Cases every run covers before the random draws: the placements where stitching order and
    pooling mode show (random draws at a few examples may miss them).

    - EC, CW shards on ranks [0, 1, 0] (the seed commit's example: permute [0, 2, 1]);
    - EC, CW shards on ranks [1, 0, 0] (a 3-cycle: an inverted permutation differs from it);
    - EBC with MEAN pooling, CW on [1, 0] beside a table-wise table.
    """
    batches = tuple(_PINNED_BATCHES[rank % 2] for rank in range(world_size))
    last = world_size - 1
    ec_tables = (TableSpec("t0", 10, 12, ("f0",)), TableSpec("t1", 7, 12, ("f1", "f0")), TableSpec("t2", 8, 12, ("f2",)))
    ebc_tables = (TableSpec("t0", 10, 8, ("f0",), "MEAN"), TableSpec("t1", 8, 12, ("f1", "f2"), "MEAN"))
    ec_kernel, ebc_kernel = kernels_for("ec", device)[0], kernels_for("ebc", device)[0]
    return (
        ShardingCase("ec", world_size, ec_tables, {"t0": ("column_wise", (0, last, 0)), "t1": ("table_wise", last), "t2": ("row_wise",)},
                     ec_kernel, need_indices=True, batches=batches, seed=5),
        ShardingCase("ec", world_size, ec_tables, {"t0": ("column_wise", (last, 0, 0)), "t1": ("table_wise", 0), "t2": ("row_wise",)},
                     ec_kernel, batches=batches, seed=6),
        ShardingCase("ebc", world_size, ebc_tables, {"t0": ("column_wise", (last, 0)), "t1": ("table_wise", 0)},
                     ebc_kernel, batches=batches, seed=7),
    )


def known_broken_cases(world_size: int, device: str) -> tuple[ShardingCase, ...]:
    """One case per combination listed in plan_strategies.BROKEN_ON_DEVICE for ``device``.

    They are run on purpose, outside the random draws, so that paritykit/known_issues.toml can mark
    their failures as known and `paritykit gate --strict` notices the day torchrec fixes them.
    """
    batches = tuple(_PINNED_BATCHES[rank % 2] for rank in range(world_size))
    tables = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2")))
    cases = []
    for broken_device, module, name in BROKEN_ON_DEVICE:
        if broken_device != device or module != "ec":
            continue
        if name == "data_parallel":
            plan, kernel = {"t0": ("column_wise", (0, world_size - 1)), "t1": ("data_parallel",)}, "fused"
        else:
            plan, kernel = {"t0": ("column_wise", (0, world_size - 1)), "t1": ("table_wise", 0)}, name
        cases.append(ShardingCase("ec", world_size, tables, plan, kernel, batches=batches, seed=8))
    return tuple(cases)
