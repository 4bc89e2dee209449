"""An optimizer-wrapper case on a sharded model: the tables and their placements and kernels, the
fused embedding optimizer, torchrec's wrappers as the user stacks them (``OptimizerWrapping``),
and several steps of per-rank batches drawn from the case's seed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from paritykit.engine.optim_model import model_factory
from paritykit.engine.optim_wrapping import OptimizerWrapping
from paritykit.harness.plans import describe_plan, normalize_plan_entry, parameter_sharding_generator
from paritykit.harness.seeding import generator, stable_seed
from paritykit.harness.tables import TableSpec, feature_names_of, kjt_from_rows

BATCH_SIZE = 3
MAX_IDS_PER_ROW = 3


@dataclass(frozen=True)
class OptimCase:
    world_size: int
    tables: tuple[TableSpec, ...]
    plan: dict[str, tuple] = field(hash=False)
    wrapping: OptimizerWrapping
    kernels: dict[str, str] = field(default_factory=dict, hash=False)  # table -> "fused" / "dense"
    embedding_optimizer: str = "sgd"
    steps: int = 4
    seed: int = 0
    label: str = ""  # what a pinned case is for

    def kernel_of(self, table: str) -> str:
        return "dense" if self.plan[table][0] == "data_parallel" else self.kernels.get(table, "fused")

    def model_parallel_dense_tables(self) -> tuple[str, ...]:
        """Tables that a dense optimizer trains in local shards (dense kernel, not data-parallel)."""
        return tuple(t.name for t in self.tables if self.plan[t.name][0] != "data_parallel" and self.kernel_of(t.name) == "dense")

    def describe(self) -> str:
        tables = ", ".join(f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {self.kernel_of(t.name)}]" for t in self.tables)
        label = f"{self.label}: " if self.label else ""
        return (f"{label}world_size={self.world_size} embedding_optimizer={self.embedding_optimizer} steps={self.steps} "
                f"plan={describe_plan(self.plan)} tables=({tables}) {self.wrapping.describe()} seed={self.seed}")

    def case_id(self) -> str:
        return f"{self.describe()} #{stable_seed(repr(self), repr(self.plan), repr(self.kernels)) % 16**8:08x}"


def torchrec_plan(case: OptimCase) -> dict[str, Any]:
    return {table: parameter_sharding_generator(normalize_plan_entry(table, entry),
                                                None if entry[0] == "data_parallel" else case.kernel_of(table))
            for table, entry in case.plan.items()}


def batches_of(case: OptimCase) -> list[list[Any]]:
    """batches[step][rank]: BATCH_SIZE rows per feature of 0-3 ids each, drawn from the case's seed."""
    keys = feature_names_of(case.tables)
    rows_of = {f: t.num_embeddings for t in case.tables for f in t.feature_names}
    steps = []
    for step in range(case.steps):
        per_rank = []
        for rank in range(case.world_size):
            g = generator("optim batch", case.seed, step, rank)
            rows = {}
            for key in keys:
                lengths = torch.randint(0, MAX_IDS_PER_ROW + 1, (BATCH_SIZE,), generator=g).tolist()
                rows[key] = [torch.randint(0, rows_of[key], (n,), generator=g).tolist() for n in lengths]
            per_rank.append(kjt_from_rows(keys, rows))
        steps.append(per_rank)
    return steps


def model_fn(case: OptimCase):
    return model_factory(case.tables, case.seed)
