"""What one sharded embedding module was run with, as plain data: the configuration a failure
carries up (``ParityError.configuration``), the known issues are matched against, and a standalone
reproduction is written from.

    config = ShardedConfiguration("ebc", 2, tables, {"t0": ("row_wise",), "t1": ("table_wise", 1)},
                                  steps=((RankBatch((("f0", ((1, 2), ())),)), ...),), seed=21)
    config.to_json()            # JSON-able; ShardedConfiguration.from_json(...) reads it back
    config.size()               # what "smallest" means among failing cases

It has the shape the sharding check's cases have (``module``, ``world_size``, ``tables``, ``plan``,
``kernel_of``, ``step_batches``), so one predicate of a known issue serves a built-in case and a
user's model alike. The tables' initial weights are ``paritykit.harness.tables.seeded_table_weight``
(a ``torch.randn`` from a generator seeded by ``init_seed``), which a script can rebuild with torch alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from paritykit.harness.plans import describe_plan, normalize_plan_entry
from paritykit.harness.seeding import stable_seed
from paritykit.harness.tables import TableSpec

Rows = tuple[tuple[int, ...], ...]
# Embedding optimizers from the simplest state (none) on: what "smallest" prefers among equal sizes.
OPTIMIZER_ORDER = ("sgd", "adagrad", "rowwise_adagrad")


@dataclass(frozen=True)
class RankBatch:
    """One rank's batch of one step: rows of ids per feature (KJT key order), per-id weights for a
    weighted EBC, and for a variable batch (VBE) the inverse indices: output row -> row of the feature."""

    ids: tuple[tuple[str, Rows], ...]
    weights: tuple[tuple[str, tuple[tuple[float, ...], ...]], ...] | None = None
    inverse: tuple[tuple[str, tuple[int, ...]], ...] | None = None

    def shape(self) -> tuple[int, ...]:
        """Rows per feature, then the output rows of a variable batch."""
        rows = tuple(len(rows) for _, rows in self.ids)
        return rows + ((len(self.inverse[0][1]),) if self.inverse else ())

    def id_count(self) -> int:
        return sum(len(row) for _, rows in self.ids for row in rows)


@dataclass(frozen=True)
class ShardedConfiguration:
    """One embedding module ("ebc" or "ec") sharded by ``plan`` (paritykit's short placements) over
    ``world_size`` ranks and trained ``len(steps)`` steps on ``steps[step][rank]``."""

    module: str
    world_size: int
    tables: tuple[TableSpec, ...]
    plan: dict[str, tuple] = field(hash=False)
    kernels: dict[str, str] = field(default_factory=dict, hash=False)  # table -> "fused" | "dense" | ...
    steps: tuple[tuple[RankBatch, ...], ...] = field(default=(), hash=False)
    weighted: bool = False
    need_indices: bool = False
    optimizer: str = "sgd"
    dense_optimizer: str = "sgd"
    lr: float = 0.1
    seed: int = 0
    device: str = "cpu"
    train: bool = True
    # Forms one step's batch is fed in, in order, to one sharded module, forward only ("kjt", "td"):
    # for defects that depend on what the module was fed before. Empty: one KJT per step.
    feedings: tuple[str, ...] = ()
    fqn: str = ""  # where the module sits in a user's model
    source: str = ""  # what it was taken from (a check's case), for the reader
    # The ranks stand for hosts of this many ranks each (torchrec reads LOCAL_WORLD_SIZE); None: one host.
    ranks_per_host: int | None = None

    def kernel_of(self, table: str) -> str:
        if self.plan[table][0] == "data_parallel":
            return "dense"
        return self.kernels.get(table, "fused")

    def step_batches(self) -> tuple[tuple[RankBatch, ...], ...]:
        return self.steps

    @property
    def variable_batch(self) -> bool:
        return any(batch.inverse is not None for step in self.steps for batch in step)

    @property
    def uneven_batches(self) -> bool:
        """Ranks with different batch shapes at some step."""
        return any(len({batch.shape() for batch in step}) > 1 for step in self.steps)

    def init_seed(self, table: TableSpec) -> int:
        """The seed of ``torch.randn(rows, dim, generator=...)`` that gives the table's initial weight."""
        return stable_seed("table", self.seed, table.name)

    def size(self) -> tuple[int, ...]:
        """Smaller is simpler: ranks, steps, the optimizer (SGD first: its state is nothing), tables, ids,
        table elements."""
        ids = self.id_count()
        optimizer = OPTIMIZER_ORDER.index(self.optimizer) if self.optimizer in OPTIMIZER_ORDER else len(OPTIMIZER_ORDER)
        return (self.world_size, len(self.steps), optimizer, len(self.tables), ids,
                sum(t.num_embeddings * t.embedding_dim for t in self.tables))

    def id_count(self) -> int:
        return sum(batch.id_count() for step in self.steps for batch in step)

    def placement_of(self, table: str) -> str:
        """"row_wise MEAN fused": the table's sharding type, pooling (EBC) and kernel."""
        spec = next(t for t in self.tables if t.name == table)
        pooling = f" {spec.pooling}" if self.module == "ebc" else ""
        return f"{self.plan[table][0]}{pooling} {self.kernel_of(table)}"

    def describe(self) -> str:
        tables = ", ".join(f"{t.name}[{t.num_embeddings}x{t.embedding_dim} {'/'.join(t.feature_names)}"
                           + (f" {t.pooling}" if self.module == "ebc" else "") + f" {self.kernel_of(t.name)}]"
                           for t in self.tables)
        flags = [f"weighted={self.weighted}" if self.module == "ebc" else f"need_indices={self.need_indices}"]
        flags += ["variable_batch=True"] if self.variable_batch else []
        flags += [] if self.train else ["forward only"]
        where = f" at {self.fqn!r}" if self.fqn else ""
        hosts = f" hosts={self.world_size // self.ranks_per_host}x{self.ranks_per_host}" if self.on_several_hosts else ""
        return (f"{self.module}{where} world_size={self.world_size}{hosts} {' '.join(flags)} optimizer={self.optimizer} "
                f"lr={self.lr:g} steps={len(self.steps)} plan={describe_plan(self.plan)} tables=({tables})")

    @property
    def on_several_hosts(self) -> bool:
        return self.ranks_per_host is not None and self.ranks_per_host < self.world_size

    def to_json(self) -> dict[str, Any]:
        hosts = {"ranks_per_host": self.ranks_per_host} if self.on_several_hosts else {}  # one host: as before
        return {**hosts, 
            "module": self.module, "world_size": self.world_size,
            "tables": [{"name": t.name, "num_embeddings": t.num_embeddings, "embedding_dim": t.embedding_dim,
                        "feature_names": list(t.feature_names), "pooling": t.pooling, "init_seed": self.init_seed(t)}
                       for t in self.tables],
            "plan": {table: list(_jsonable(entry)) for table, entry in self.plan.items()},
            "kernels": {t.name: self.kernel_of(t.name) for t in self.tables},
            "steps": [[_batch_json(batch) for batch in step] for step in self.steps],
            "weighted": self.weighted, "need_indices": self.need_indices, "optimizer": self.optimizer,
            "dense_optimizer": self.dense_optimizer, "lr": self.lr, "seed": self.seed, "device": self.device,
            "train": self.train, "feedings": list(self.feedings), "fqn": self.fqn, "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShardedConfiguration":
        tables = tuple(TableSpec(t["name"], t["num_embeddings"], t["embedding_dim"], tuple(t["feature_names"]), t["pooling"])
                       for t in data["tables"])
        plan = {table: normalize_plan_entry(table, entry) for table, entry in data["plan"].items()}
        steps = tuple(tuple(_batch_from_json(batch) for batch in step) for step in data["steps"])
        scalars = {key: data[key] for key in ("weighted", "need_indices", "optimizer", "dense_optimizer", "lr", "seed",
                                               "device", "train", "fqn", "source", "ranks_per_host") if key in data}
        scalars["feedings"] = tuple(data.get("feedings", ()))
        return cls(data["module"], data["world_size"], tables, plan, dict(data.get("kernels", {})), steps, **scalars)

    def with_steps(self, steps: tuple[tuple[RankBatch, ...], ...]) -> "ShardedConfiguration":
        return replace(self, steps=steps)


def _jsonable(entry: tuple) -> tuple:
    return tuple(list(part) if isinstance(part, tuple) else part for part in entry)


def _batch_json(batch: RankBatch) -> dict[str, Any]:
    out: dict[str, Any] = {"ids": {key: [list(row) for row in rows] for key, rows in batch.ids}}
    if batch.weights is not None:
        out["weights"] = {key: [list(row) for row in rows] for key, rows in batch.weights}
    if batch.inverse is not None:
        out["inverse"] = {key: list(rows) for key, rows in batch.inverse}
    return out


def _batch_from_json(data: dict[str, Any]) -> RankBatch:
    ids = tuple((key, tuple(tuple(int(v) for v in row) for row in rows)) for key, rows in data["ids"].items())
    weights = data.get("weights")
    inverse = data.get("inverse")
    return RankBatch(
        ids,
        None if weights is None else tuple((key, tuple(tuple(float(w) for w in row) for row in rows)) for key, rows in weights.items()),
        None if inverse is None else tuple((key, tuple(int(i) for i in rows)) for key, rows in inverse.items()),
    )


def configurations(value: Any) -> tuple[ShardedConfiguration, ...]:
    """A failure's configuration as a tuple of module configurations (it may carry one or several)."""
    if value is None:
        return ()
    if isinstance(value, ShardedConfiguration):
        return (value,)
    if isinstance(value, dict):
        return (ShardedConfiguration.from_json(value),)
    return tuple(c for item in value for c in configurations(item))


def configuration_json(value: Any) -> dict[str, Any] | None:
    """The JSON of a failure's configuration when it is one module's (what a reproduction is written from)."""
    found = configurations(value)
    return found[0].to_json() if len(found) == 1 else None


@contextlib.contextmanager
def described_by(configuration: Callable[[BaseException], Any]) -> Iterator[None]:
    """An exception escaping the block carries ``configuration(exc)`` (built only then) unless it
    carries one already: what a failure ran, for its known issue and its reproduction."""
    try:
        yield
    except Exception as exc:
        if getattr(exc, "configuration", None) is None:
            try:
                exc.configuration = configuration(exc)
            except Exception as failed:  # noqa: BLE001 - describing must not replace the failure
                exc.add_note(f"paritykit could not describe the configuration: {type(failed).__name__}: {failed}")
        raise
