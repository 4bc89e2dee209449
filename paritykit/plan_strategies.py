"""Hypothesis strategies for embedding tables, sharding plans and sparse batches.

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

from paritykit.models import TableSpec, describe_plan

SHARD_WIDTHS = (4, 8)
CW_SHARD_COUNTS = (2, 3, 4)

# (device type, module, placement or kernel) combinations that fail inside torchrec 1.8, with why.
BROKEN_ON_DEVICE: dict[tuple[str, str, str], str] = {
    ("cpu", "ec", "dense"): "sharded EC with the dense kernel on CPU returns pooled rows (split sizes do not match)",
    ("cpu", "ec", "data_parallel"): "a data-parallel table in a sharded EC on CPU returns pooled rows",
}


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
    """False for a (module, sharding type or kernel) combination known to fail inside torchrec on ``device``."""
    return (device, module, name) not in BROKEN_ON_DEVICE


def _supported(device: str, module: str, name: str) -> bool:
    return (device, module, name) not in BROKEN_ON_DEVICE


def placements_for(module: str, device: str) -> tuple[str, ...]:
    """The sharding types torchrec's sharder for ``module`` accepts that a paritykit plan can express,
    minus the ones broken on ``device``."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    sharder = {"ec": EmbeddingCollectionSharder, "ebc": EmbeddingBagCollectionSharder}[module]()
    from paritykit.models import PLAN_KINDS

    return tuple(t for t in sharder.sharding_types(device) if t in PLAN_KINDS and _supported(device, module, t))


def kernels_for(module: str, device: str) -> tuple[str, ...]:
    """Kernels for the model-parallel tables of a case (data-parallel tables always use dense)."""
    from paritykit.models import compute_kernels

    return tuple(k for k in compute_kernels(device, "column_wise", module) if _supported(device, module, k))


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
    kernel = draw(st.sampled_from(kernels_for(module, device)))
    need_indices = module == "ec" and draw(st.booleans())

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
    return ShardingCase(
        module=module,
        world_size=world_size,
        tables=tuple(tables),
        plan=plan,
        kernel=kernel,
        need_indices=need_indices,
        weighted=weighted,
        batches=tuple(batches),
        weights=tuple(weights) if weighted else None,
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def shard_rank_placements(draw: Any, max_world_size: int = 4, max_shards: int = 6) -> list[int]:
    """Arbitrary CW shard ranks: repeats and unsorted orders included."""
    world_size = draw(st.integers(1, max_world_size))
    return draw(st.lists(st.integers(0, world_size - 1), min_size=1, max_size=max_shards))
