"""What one sharded td-kjt case is: tables, a per-table plan, one kernel, and the batches that the
module, sharded once, is fed (``steps[step][rank]``), each batch with inverse indices when the
batch size varies per feature (VBE).

Routes by which a batch reaches the sharded module:
- "kjt": the KeyedJaggedTensor built directly from the drawn rows (the reference form);
- "td-paritykit": the TensorDict form converted by ``paritykit.convert.td_to_kjt``;
- "td-torchrec": the TensorDict itself (torchrec converts it in the sharded ``input_dist``), only
  where this torchrec takes that form (unweighted, one batch size, contiguous jagged tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paritykit.errors import HarnessError
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.plans import describe_plan, validate_plan, with_rows_for_every_rank
from paritykit.harness.tables import TableSpec, feature_names_of
from paritykit.strategies import SparseBatch

ROUTE_KJT = "kjt"
ROUTE_PARITYKIT = "td-paritykit"
ROUTE_TORCHREC = "td-torchrec"
ROUTES = (ROUTE_KJT, ROUTE_PARITYKIT, ROUTE_TORCHREC)


@dataclass(frozen=True)
class RankBatch:
    """One rank's batch. With ``inverse``, feature k has its own batch size B_k and the module's
    output has B rows: row b of feature k repeats the feature's row ``inverse[k][b]``."""

    batch: SparseBatch
    inverse: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.inverse is None:
            return
        if len(self.inverse) != len(self.batch.keys):
            raise HarnessError(f"inverse indices for {len(self.inverse)} features, the batch has {len(self.batch.keys)}")
        widths = {len(rows) for rows in self.inverse}
        if len(widths) != 1:
            raise HarnessError(f"inverse indices of different widths {sorted(widths)}: one output batch size for all features")
        for key, rows, size in zip(self.batch.keys, self.inverse, self.batch.batch_sizes):
            bad = [r for r in rows if not 0 <= r < size]
            if bad:
                raise HarnessError(f"feature {key!r}: inverse indices {bad} outside its batch size {size}")

    @property
    def output_batch_size(self) -> int:
        return len(self.inverse[0]) if self.inverse is not None else self.batch.batch_sizes[0]

    def expanded_lengths(self) -> tuple[tuple[int, ...], ...]:
        """Per feature, the length of each of the output's B rows (the rows repeated by ``inverse``)."""
        if self.inverse is None:
            return self.batch.lengths
        return tuple(tuple(rows[i] for i in inv) for rows, inv in zip(self.batch.lengths, self.inverse))

    def __repr__(self) -> str:
        b = self.batch
        inverse = "" if self.inverse is None else f", inverse={self.inverse}"
        return f"RankBatch(lengths={b.lengths}, seed={b.seed}{inverse})"


@dataclass(frozen=True)
class ShardedCase:
    """One plan sharded once and fed ``len(steps)`` batches per rank. Picklable: it travels to every rank."""

    module: str  # "ebc" or "ec"
    world_size: int
    tables: tuple[TableSpec, ...]
    plan: dict[str, tuple] = field(hash=False)
    kernel: str
    routes: tuple[str, ...]
    form: str  # how the TensorDict's jagged tensors are built (paritykit.strategies.JAGGED_FORMS)
    steps: tuple[tuple[RankBatch, ...], ...] = field(hash=False)
    device: str  # "cpu" or "cuda": where every rank builds and runs the case
    weighted: bool = False
    need_indices: bool = False
    seed: int = 0
    train: bool = True  # False: outputs only (where torchrec cannot train the configuration on the device)
    # The hosts the ranks stand for (None: one host of world_size ranks; host_cases in pinned.py).
    ranks_per_host: int | None = None

    def __post_init__(self) -> None:
        """A bad case is refused here, in the caller, naming the table, route, step or rank at fault."""
        validate_plan(self.tables, self.plan, self.world_size)
        if self.device == "cpu":
            # An empty row shard fails inside fbgemm's CPU kernel (the sharding check runs that known
            # issue on purpose); here every row-sharded table gets rows on every rank. Ids stay in range.
            object.__setattr__(self, "tables", with_rows_for_every_rank(self.tables, self.plan, self.world_size))
        unknown = [r for r in self.routes if r not in ROUTES]
        if unknown or ROUTE_KJT not in self.routes:
            raise HarnessError(f"routes {self.routes}: unknown {unknown}; {ROUTE_KJT!r} (the reference form) is required")
        if not self.steps:
            raise HarnessError("a sharded case needs at least one step of batches")
        if self.ranks_per_host is not None:
            host_layout(self.world_size, self.ranks_per_host)  # HarnessError unless it divides world_size
        for step, rank_batches in enumerate(self.steps):
            if len(rank_batches) != self.world_size:
                raise HarnessError(f"step {step} has batches for {len(rank_batches)} ranks, the case {self.world_size}")
            for rank, rank_batch in enumerate(rank_batches):
                if rank_batch.batch.keys != self.keys:
                    raise HarnessError(f"step {step} rank {rank}: batch keys {rank_batch.batch.keys} != the tables' {self.keys}")
                if (rank_batch.inverse is not None) != self.variable_batch:
                    raise HarnessError(f"step {step} rank {rank}: every batch of a case is VBE or none is")

    @property
    def keys(self) -> tuple[str, ...]:
        """The batch's keys: every feature once, however many tables look it up."""
        return feature_names_of(self.tables)

    @property
    def variable_batch(self) -> bool:
        return self.steps[0][0].inverse is not None

    def table_of_feature(self, key: str) -> TableSpec:
        return next(t for t in self.tables if key in t.feature_names)

    def plan_shape(self) -> str:
        """The plan without table names and ranks: what examples are counted by."""
        kinds = sorted(f"{e[0]}x{len(e[1])}" if e[0] == "column_wise" else e[0] for e in self.plan.values())
        vbe = "/vbe" if self.variable_batch else ""
        forward = "" if self.train else "/forward-only"
        return f"{self.module}/ws{self.world_size}{self._hosts_label('/')}/{self.kernel}{vbe}{forward}/" + "+".join(kinds)

    def _hosts_label(self, prefix: str) -> str:
        return f"{prefix}hosts={self.hosts}" if self.hosts.hosts > 1 else ""

    @property
    def hosts(self) -> HostLayout:
        return host_layout(self.world_size, self.ranks_per_host)

    def describe(self) -> str:
        tables = ", ".join(
            f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)}"
            + (f" {t.pooling}" if self.module == "ebc" else "") + "]"
            for t in self.tables
        )
        flags = f"need_indices={self.need_indices}" if self.module == "ec" else f"weighted={self.weighted}"
        return (
            f"sharded {self.module} ws{self.world_size}{self._hosts_label(' ')} kernel={self.kernel} {flags} vbe={self.variable_batch} "
            f"train={self.train} "
            f"routes={'+'.join(self.routes)} form={self.form} device={self.device} plan={describe_plan(self.plan)} "
            f"tables=({tables}) seed={self.seed} steps={self.steps!r}"
        )
