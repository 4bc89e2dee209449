"""A planner case: an EBC or EC whose tables carry the user's ParameterConstraints, planned by
torchrec's EmbeddingShardingPlanner for some hosts of ranks, then trained sharded by that plan."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from paritykit.harness.configuration import RankBatch
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.seeding import stable_seed
from paritykit.harness.tables import TableSpec, build_ebc, build_ec, feature_names_of, kjt_from_rows


@dataclass(frozen=True)
class TableConstraint:
    """What a user asks of one table's placement (torchrec's ParameterConstraints)."""

    sharding_types: tuple[str, ...]
    min_partition: int | None = None  # the narrowest column-wise shard

    def describe(self) -> str:
        return "|".join(self.sharding_types) + (f" min_partition={self.min_partition}" if self.min_partition else "")


@dataclass(frozen=True)
class PlannerCase:
    module: str  # "ebc" or "ec"
    world_size: int
    ranks_per_host: int
    tables: tuple[TableSpec, ...]
    constraints: tuple[tuple[str, TableConstraint], ...]  # (table, its constraint)
    steps: tuple[tuple[RankBatch, ...], ...]
    optimizer: str = "sgd"
    seed: int = 0

    @property
    def hosts(self) -> HostLayout:
        return host_layout(self.world_size, self.ranks_per_host)

    def constraint_of(self, table: str) -> TableConstraint:
        return dict(self.constraints)[table]

    def describe(self) -> str:
        tables = ", ".join(f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)}"
                           + (f" {t.pooling}" if self.module == "ebc" else "") + f" {self.constraint_of(t.name).describe()}]"
                           for t in self.tables)
        return (f"{self.module} planned for {self.hosts.describe()} optimizer={self.optimizer} steps={len(self.steps)} "
                f"tables=({tables}) seed={self.seed}")

    def case_id(self) -> str:
        return f"{self.describe()} #{stable_seed(repr(self)) % 16**8:08x}"


def build_module(module: str, tables: tuple[TableSpec, ...], seed: int, weighted: bool = False) -> Any:
    """The case's unsharded module with seeded weights (module level: the ranks build it too);
    ``weighted``: an EBC whose features carry weights."""
    return build_ec(tables, seed=seed) if module == "ec" else build_ebc(tables, seed=seed, is_weighted=weighted)


def model_fn(case: PlannerCase, weighted: bool = False) -> Any:
    return functools.partial(build_module, case.module, case.tables, case.seed, weighted)


def batches_of(case: PlannerCase) -> list[list[Any]]:
    keys = list(feature_names_of(case.tables))
    return [[kjt_from_rows(keys, {key: rows for key, rows in batch.ids}) for batch in step] for step in case.steps]
