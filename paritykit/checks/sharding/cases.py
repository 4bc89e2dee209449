"""A sharding case: an EC or EBC, a plan over its tables, the kernels, the optimizer and several
steps of per-rank batches; and how it becomes the (model_fn, plan, batches) that
``assert_sharded_matches_unsharded`` takes — the built-in cases go through the same path as a
user's model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from paritykit.harness.configuration import RankBatch, ShardedConfiguration
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.optimizers import OptimizerSpec
from paritykit.harness.plans import describe_plan, normalize_plan_entry, parameter_sharding_generator
from paritykit.harness.seeding import stable_seed
from paritykit.harness.tables import TableSpec, build_ebc, build_ec, feature_names_of

Rows = tuple[tuple[int, ...], ...]
KERNEL_CHOSEN_BY_TORCHREC = ("grid_shard", "table_row_wise")


@dataclass(frozen=True)
class ShardingCase:
    """One sharded-vs-unsharded training case. ``plan`` holds paritykit's short placements;
    ``kernels`` a compute kernel per table ("fused" or "dense"; data-parallel tables are dense)."""

    module: str  # "ec" or "ebc"
    world_size: int
    tables: tuple[TableSpec, ...]
    plan: dict[str, tuple] = field(hash=False)
    kernel: str = "fused"
    need_indices: bool = False
    weighted: bool = False
    # The single-step form (rows per feature per rank); kept for the legacy constructor.
    batches: tuple[dict[str, Rows], ...] = field(default=(), hash=False)
    weights: tuple[dict[str, tuple[tuple[float, ...], ...]], ...] | None = field(default=None, hash=False)
    seed: int = 0
    kernels: dict[str, str] = field(default_factory=dict, hash=False)
    # A name ("sgd", "rowwise_adagrad", ...) or an OptimizerSpec with its hyper-parameters.
    optimizer: str | OptimizerSpec = "sgd"
    dense_optimizer: str | OptimizerSpec = "sgd"
    steps: tuple[tuple[RankBatch, ...], ...] = field(default=(), hash=False)
    # The hosts the ranks stand for (None: one host of world_size ranks); the plan is resolved for
    # them. Out of the repr (which the case id hashes) so one-host ids stay as they were; describe() says it.
    ranks_per_host: int | None = field(default=None, repr=False)

    @property
    def hosts(self) -> HostLayout:
        return host_layout(self.world_size, self.ranks_per_host)

    def kernel_of(self, table: str) -> str:
        if self.plan[table][0] == "data_parallel":
            return "dense"
        return self.kernels.get(table, self.kernel)

    def trained_kernel(self, table: str) -> str:
        """The kernel torchrec trains ``table`` with: grid and table-row-wise generators take no kernel,
        and torchrec picks the fused one for a table that carries an in-backward optimizer."""
        if self.plan[table][0] in KERNEL_CHOSEN_BY_TORCHREC:
            return "fused"
        return self.kernel_of(table)

    def step_batches(self) -> tuple[tuple[RankBatch, ...], ...]:
        if self.steps:
            return self.steps
        weights = self.weights or (None,) * len(self.batches)
        return (tuple(RankBatch(tuple(b.items()), None if w is None else tuple(w.items())) for b, w in zip(self.batches, weights)),)

    def plan_shape(self) -> str:
        """The plan with table names and ranks left out: what a count of examples is grouped by."""
        kinds = sorted(f"{e[0]}x{len(e[1])}" if e[0] in ("column_wise", "column_wise_sized", "table_column_wise") else e[0]
                       for e in self.plan.values())
        vbe = "/vbe" if any(b.inverse for step in self.steps for b in step) else ""
        return f"{self.module}/ws{self.world_size}{self._hosts_label('/')}/{optimizer_name(self.optimizer)}/" + "+".join(kinds) + vbe

    def _hosts_label(self, prefix: str) -> str:
        return f"{prefix}hosts={self.hosts}" if self.hosts.hosts > 1 else ""

    def describe(self) -> str:
        tables = ", ".join(
            f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)}"
            + (f" {t.pooling}" if self.module == "ebc" else "") + f" {self.trained_kernel(t.name)}]"
            for t in self.tables
        )
        flags = f"need_indices={self.need_indices}" if self.module == "ec" else f"weighted={self.weighted}"
        if any(batch.inverse is not None for step in self.step_batches() for batch in step):
            flags += " variable_batch=True"
        return (f"{self.module} world_size={self.world_size}{self._hosts_label(' ')} {flags} optimizer={optimizer_text(self.optimizer)}/{optimizer_text(self.dense_optimizer)} "
                f"steps={len(self.step_batches())} plan={describe_plan(self.plan)} tables=({tables}) seed={self.seed}")

    def case_id(self) -> str:
        return f"{self.describe()} #{stable_seed(repr(self), repr(self.step_batches())) % 16**8:08x}"


def optimizer_name(optimizer: str | OptimizerSpec) -> str:
    return optimizer if isinstance(optimizer, str) else optimizer.name


def optimizer_text(optimizer: str | OptimizerSpec) -> str:
    return optimizer if isinstance(optimizer, str) else optimizer.describe()


def build_module(module: str, tables: tuple[TableSpec, ...], weighted: bool, need_indices: bool, seed: int) -> torch.nn.Module:
    """The case's unsharded module with seeded weights (module level: the ranks build it too)."""
    if module == "ec":
        return build_ec(tables, seed=seed, need_indices=need_indices)
    return build_ebc(tables, seed=seed, is_weighted=weighted)


def model_fn(case: ShardingCase):
    return functools.partial(build_module, case.module, case.tables, case.weighted, case.need_indices, case.seed)


def torchrec_plan(case: ShardingCase) -> dict[str, Any]:
    """{table: torchrec ParameterShardingGenerator} with the case's kernels."""
    return {
        table: parameter_sharding_generator(normalize_plan_entry(table, entry), None if entry[0] == "data_parallel" else case.kernel_of(table))
        for table, entry in case.plan.items()
    }


def kjt_of(batch: RankBatch, weighted: bool):
    """The KeyedJaggedTensor of one rank batch (variable batch per feature with inverse indices for VBE)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [key for key, _ in batch.ids]
    lengths = [len(row) for _, rows in batch.ids for row in rows]
    values = [v for _, rows in batch.ids for row in rows for v in row]
    weights = None
    if weighted:
        by_key = dict(batch.weights or ())
        weights = torch.tensor([w for key in keys for row in by_key[key] for w in row], dtype=torch.float32)
    kwargs: dict[str, Any] = {}
    if batch.inverse is not None:
        kwargs["stride_per_key_per_rank"] = [[len(rows)] for _, rows in batch.ids]
        kwargs["inverse_indices"] = (keys, torch.tensor([list(index) for _, index in batch.inverse], dtype=torch.int64))
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                             lengths=torch.tensor(lengths, dtype=torch.int32), weights=weights, **kwargs)


def expanded(batch: RankBatch) -> RankBatch:
    """A variable batch as the fixed batch it stands for, by paritykit's own row arithmetic: output
    row b of feature k is row ``inverse[k][b]`` of that feature's rows (ids and weights alike)."""
    if batch.inverse is None:
        return batch
    inverse = dict(batch.inverse)
    ids = tuple((key, tuple(rows[i] for i in inverse[key])) for key, rows in batch.ids)
    weights = None if batch.weights is None else tuple((key, tuple(rows[i] for i in inverse[key])) for key, rows in batch.weights)
    return RankBatch(ids, weights)


def batches_of(case: ShardingCase) -> list[list[Any]]:
    return [[kjt_of(batch, case.weighted) for batch in step] for step in case.step_batches()]


def feature_order(case: ShardingCase) -> tuple[str, ...]:
    return feature_names_of(case.tables)


def configuration_of(case: ShardingCase, device: str = "cpu") -> ShardedConfiguration:
    """The case as the plain data a failure carries (its known issue, its standalone reproduction)."""
    return ShardedConfiguration(case.module, case.world_size, case.tables, dict(case.plan),
                                {t.name: case.kernel_of(t.name) for t in case.tables}, case.step_batches(), case.weighted,
                                case.need_indices, optimizer_name(case.optimizer), optimizer_name(case.dense_optimizer),
                                seed=case.seed, device=device, ranks_per_host=case.ranks_per_host,
                                source=f"sharding check: {case.describe()}")
