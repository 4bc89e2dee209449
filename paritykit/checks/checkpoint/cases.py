"""A checkpoint case: an EC or EBC, the plan it is saved under and the plan (and world size) it is
reloaded into, kernels, optimizers, how the checkpoint is made, and per-rank batches before and after
the save; and how it becomes the (model_fn, plan, batches, ...) that ``assert_checkpoint_roundtrip``
takes: the built-in cases go through the same path as a user's model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from paritykit.engine.checkpoint import CheckpointRecipe
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.plans import describe_plan, normalize_plan_entry, parameter_sharding_generator
from paritykit.harness.seeding import stable_seed
from paritykit.harness.tables import TableSpec, build_ebc, build_ec, kjt_from_rows

Rows = tuple[tuple[int, ...], ...]
# One rank's batch of one step: (feature, rows of ids) in the KJT's key order.
RankBatch = tuple[tuple[str, Rows], ...]
Steps = tuple[tuple[RankBatch, ...], ...]


@dataclass(frozen=True)
class CheckpointCase:
    """``steps[step][rank]`` on ``world_size`` ranks, saved after ``save_after`` steps; the resumed run
    trains ``reload_steps`` on ``reload_world_size`` ranks, or (None) the saving run's own steps after
    the save. ``kernels[table]``: "fused" or "dense" (data-parallel tables are dense)."""

    module: str  # "ec" or "ebc"
    tables: tuple[TableSpec, ...]
    plan: dict[str, tuple] = field(hash=False)
    reload_plan: dict[str, tuple] = field(hash=False)
    world_size: int
    reload_world_size: int
    steps: Steps = field(hash=False)
    save_after: int = 1
    reload_steps: Steps | None = field(default=None, hash=False)
    kernels: dict[str, str] = field(default_factory=dict, hash=False)
    optimizer: str = "sgd"
    dense_optimizer: str = "sgd"
    recipe: CheckpointRecipe = CheckpointRecipe()
    seed: int = 0
    # Both runs' ranks stand for hosts of this many ranks (None: one host); out of repr, so that the
    # one-host cases keep their ids.
    ranks_per_host: int | None = field(default=None, repr=False)

    @property
    def hosts(self) -> HostLayout:
        return host_layout(self.world_size, self.ranks_per_host)

    def kernel_of(self, table: str) -> str:
        return "dense" if self.plan[table][0] == "data_parallel" else self.kernels.get(table, "fused")

    def block_counts(self, which: str = "plan") -> dict[str, int]:
        """Column blocks per table (what row-wise optimizer state is kept per): CW/TWCW shards, GRID hosts."""
        plan = getattr(self, which)
        return {t: len(e[1]) if e[0] in ("column_wise", "table_column_wise", "grid_shard") else 1 for t, e in plan.items()}

    def plan_shape(self) -> str:
        """The plans with table names and ranks left out: what a count of examples is grouped by."""
        def shape(plan: dict[str, tuple]) -> str:
            return "+".join(sorted(f"{e[0]}x{len(e[1])}" if e[0] in ("column_wise", "table_column_wise") else e[0] for e in plan.values()))

        sizes = f"{self.hosts}" if self.ranks_per_host is not None else f"ws{self.world_size}->{self.reload_world_size}"
        return (f"{self.module}/{sizes}/{self.optimizer}+{self.dense_optimizer}/"
                f"{self.recipe.describe()}/{shape(self.plan)}->{shape(self.reload_plan)}")

    def describe(self) -> str:
        tables = ", ".join(f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)} {self.kernel_of(t.name)}]"
                           for t in self.tables)
        reload = (f"reload_steps={len(self.reload_steps)}" if self.reload_steps is not None else "carried on")
        hosts = f" on {self.hosts}" if self.ranks_per_host is not None else ""
        return (f"{self.module}{hosts} {self.recipe.describe()} optimizer={self.optimizer}/{self.dense_optimizer} "
                f"saved on ws{self.world_size} {describe_plan(self.plan)} after {self.save_after} of {len(self.steps)} steps, "
                f"reloaded on ws{self.reload_world_size} {describe_plan(self.reload_plan)} ({reload}) tables=({tables}) seed={self.seed}")

    def case_id(self) -> str:
        return f"{self.describe()} #{stable_seed(repr(self), repr(self.steps), repr(self.reload_steps)) % 16**8:08x}"


def build_module(module: str, tables: tuple[TableSpec, ...], seed: int) -> torch.nn.Module:
    """The case's unsharded module with seeded weights (module level: the ranks build it too)."""
    return build_ec(tables, seed=seed) if module == "ec" else build_ebc(tables, seed=seed)


def model_fn(case: CheckpointCase):
    return functools.partial(build_module, case.module, case.tables, case.seed)


def torchrec_plan(case: CheckpointCase, which: str = "plan") -> dict[str, Any]:
    """{table: torchrec ParameterShardingGenerator} of the saved (or "reload_plan") plan with the case's kernels."""
    plan = getattr(case, which)
    return {table: parameter_sharding_generator(normalize_plan_entry(table, entry),
                                                None if entry[0] == "data_parallel" else case.kernel_of(table))
            for table, entry in plan.items()}


def kjt_of(batch: RankBatch):
    keys = [key for key, _ in batch]
    return kjt_from_rows(keys, {key: [list(row) for row in rows] for key, rows in batch})


def batches_of(steps: Steps) -> list[list[Any]]:
    return [[kjt_of(batch) for batch in step] for step in steps]


def roundtrip_arguments(case: CheckpointCase) -> tuple[tuple, dict[str, Any]]:
    """The (args, kwargs) of ``assert_checkpoint_roundtrip`` for this case."""
    kwargs = dict(save_after=case.save_after, reload_plan=torchrec_plan(case, "reload_plan"),
                  reload_batches=None if case.reload_steps is None else batches_of(case.reload_steps),
                  method=case.recipe.method, combined_optimizer=case.recipe.combined, warmup=case.recipe.warmup,
                  save_param_groups=case.recipe.param_groups,
                  embedding_optimizer=case.optimizer, dense_optimizer=case.dense_optimizer, seed=case.seed,
                  ranks_per_host=case.ranks_per_host)
    return (model_fn(case), torchrec_plan(case), batches_of(case.steps)), kwargs


def case_setup(case: CheckpointCase):
    """The case resolved into the engine's CheckpointSetup, as the assertion resolves it."""
    from paritykit.engine.checkpoint_setup import build_checkpoint_setup

    (model, plan, batches), kwargs = roundtrip_arguments(case)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("method", "combined_optimizer", "warmup", "save_param_groups")}
    return build_checkpoint_setup(model, plan, batches, recipe=case.recipe, **kwargs)
