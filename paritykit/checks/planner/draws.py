"""Hypothesis draws of planner cases: 1-3 tables of an EBC or EC, each with constraints a user
writes (a non-empty set of the sharding types the module's sharder offers on the CPU, a
min_partition for column-wise shards), planned for one host or several, trained 2 steps."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from paritykit.checks.planner.cases import PlannerCase, TableConstraint
from paritykit.harness.configuration import RankBatch
from paritykit.harness.plans import row_shard_sizes
from paritykit.harness.tables import TableSpec

# The sharding types torchrec's default sharders offer on the CPU (EmbeddingBagCollectionSharder and
# EmbeddingCollectionSharder.sharding_types("cpu")). An EC is never data-parallel here: that is a
# known torchrec issue (ec-data-parallel) the sharding check covers.
SHARDING_TYPES = {"ebc": ("data_parallel", "table_wise", "column_wise", "table_column_wise"),
                  "ec": ("table_wise", "column_wise", "row_wise")}
DIMS = (4, 8, 12, 16, 24, 32)
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
BATCH = 2  # rows per feature per rank: the same on every rank (uneven batches on RW are a known issue)
STEPS = 2


@st.composite
def _constraint(draw: Any, module: str, dim: int) -> TableConstraint:
    kinds = tuple(draw(st.lists(st.sampled_from(SHARDING_TYPES[module]), min_size=1, max_size=3, unique=True)))
    column_wise = any(kind in ("column_wise", "table_column_wise") for kind in kinds)
    min_partition = draw(st.sampled_from([None] + [w for w in (4, 8, 12) if w <= dim])) if column_wise else None
    return TableConstraint(tuple(sorted(kinds)), min_partition)


def _rows_for_every_rank(rows: int, world_size: int) -> int:
    # A row-wise shard without rows is a known torchrec CPU issue (row-wise-shard-without-rows).
    return rows if 0 not in row_shard_sizes(rows, world_size) else world_size * -(-rows // world_size)


@st.composite
def planner_cases(draw: Any, world_size: int, ranks_per_host: int) -> PlannerCase:
    module = draw(st.sampled_from(("ebc", "ec")))
    count = draw(st.integers(1, 3))
    shared_dim = draw(st.sampled_from(DIMS))  # an EC's tables share one dimension
    tables = []
    for index in range(count):
        dim = shared_dim if module == "ec" else draw(st.sampled_from(DIMS))
        rows = _rows_for_every_rank(draw(st.integers(2, 40)), world_size)
        features = tuple(f"f{index}_{k}" for k in range(draw(st.integers(1, 2))))
        pooling = draw(st.sampled_from(("SUM", "MEAN"))) if module == "ebc" else "SUM"
        tables.append(TableSpec(f"t{index}", rows, dim, features, pooling))
    constraints = tuple((t.name, draw(_constraint(module, t.embedding_dim))) for t in tables)
    steps = tuple(tuple(RankBatch(tuple((f, tuple(tuple(draw(st.lists(st.integers(0, t.num_embeddings - 1), max_size=3)))
                                                        for _ in range(BATCH)))
                                        for t in tables for f in t.feature_names))
                        for _ in range(world_size))
                  for _ in range(STEPS))
    return PlannerCase(module, world_size, ranks_per_host, tuple(tables), constraints, steps,
                       optimizer=draw(st.sampled_from(OPTIMIZERS)), seed=draw(st.integers(0, 2**16)))
