"""Unsharded and sharded embedding modules built from a small spec, and their weights.

The API other checks rely on (keep it stable; extend, don't rename):

    tables = (TableSpec("t0", num_embeddings=10, embedding_dim=8, feature_names=("f0", "f1")), ...)
    ec  = build_ec(tables, seed=0, need_indices=False)       # EmbeddingCollection
    ebc = build_ebc(tables, seed=0, is_weighted=False)       # EmbeddingBagCollection (TableSpec.pooling)
    full = seeded_full_weights(tables, seed=0)               # {table: tensor}, what build_* loads

    # inside a rank with the default process group initialised:
    plan = {"t0": ("column_wise", (0, 1, 0)), "t1": ("table_wise", 1), "t2": ("row_wise",),
            "t3": ("table_row_wise", 0), "t4": ("data_parallel",)}
    sharded = shard_module(ec, plan, device="cpu", compute_kernel="fused", learning_rate=0.1)
    copy_full_weights_into(sharded, full)                    # one full tensor per table -> local shards
    gather_full_weights(sharded)                             # every rank gets {table: full tensor}
    sgd_step_dense_parameters(sharded, lr)                   # the step the fused kernel does in backward

    kjt = kjt_from_rows(("f0", "f1"), {"f0": [[1, 2], []], "f1": [[], [3]]})
    compute_kernels("cpu", "column_wise", module="ec")       # kernels torchrec offers for that placement

Weights are deterministic functions of (seed, table name), so every rank and the parent build the
same numbers without communicating. Fused kernels get an EXACT_SGD optimizer applied inside backward;
dense kernels (and data-parallel tables, which only have a dense kernel) are stepped by
``sgd_step_dense_parameters``. Data-parallel gradients are averaged over ranks (DDP), and so are
model-parallel ones while torchrec's all-to-all gradient division is on (its default,
``torchrec.distributed.comm_ops.get_gradient_division()``); a reference must mirror that.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError, ParityError

POOLINGS = ("SUM", "MEAN")

# Plan entry kinds and the number of arguments each takes.
PLAN_KINDS = {"column_wise": 1, "table_wise": 1, "row_wise": 0, "table_row_wise": 1, "data_parallel": 0}

# torchrec's names for the sharding types behind each plan kind.
SHARDING_TYPE_OF_KIND = {
    "column_wise": "column_wise",
    "table_wise": "table_wise",
    "row_wise": "row_wise",
    "table_row_wise": "table_row_wise",
    "data_parallel": "data_parallel",
}


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: its size, the features that look it up and (for EBC) how bags pool."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str = "SUM"

    def __post_init__(self) -> None:
        if not self.feature_names:
            raise ValueError(f"table {self.name!r} has no feature names")
        if self.num_embeddings < 1 or self.embedding_dim < 1:
            raise ValueError(
                f"table {self.name!r}: num_embeddings and embedding_dim must be >= 1, "
                f"got {self.num_embeddings} x {self.embedding_dim}"
            )
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}")


def feature_names_of(tables: Sequence[TableSpec]) -> tuple[str, ...]:
    """Every feature of the tables, once each, in first-seen order (the KJT key order used here)."""
    return tuple(dict.fromkeys(f for t in tables for f in t.feature_names))


def seeded_table_weight(table: TableSpec, seed: int) -> torch.Tensor:
    """A deterministic float32 weight for one table; independent of the other tables in the spec."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(table.name.encode()))
    return torch.randn(table.num_embeddings, table.embedding_dim, generator=generator)


def seeded_full_weights(tables: Sequence[TableSpec], seed: int) -> dict[str, torch.Tensor]:
    return {t.name: seeded_table_weight(t, seed) for t in tables}


def build_ec(tables: Sequence[TableSpec], *, seed: int, need_indices: bool = False, device: str = "cpu") -> nn.Module:
    """An unsharded EmbeddingCollection with ``seeded_full_weights(tables, seed)`` loaded."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    configs = [
        EmbeddingConfig(
            name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim, feature_names=list(t.feature_names)
        )
        for t in tables
    ]
    module = EmbeddingCollection(tables=configs, device=torch.device(device), need_indices=need_indices)
    load_full_weights(module, seeded_full_weights(tables, seed))
    return module


def build_ebc(tables: Sequence[TableSpec], *, seed: int, is_weighted: bool = False, device: str = "cpu") -> nn.Module:
    """An unsharded EmbeddingBagCollection with ``seeded_full_weights(tables, seed)`` loaded."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.feature_names),
            pooling=PoolingType[t.pooling],
        )
        for t in tables
    ]
    module = EmbeddingBagCollection(tables=configs, is_weighted=is_weighted, device=torch.device(device))
    load_full_weights(module, seeded_full_weights(tables, seed))
    return module


def _table_of_key(key: str) -> str | None:
    # State-dict keys end in "<table>.weight" under "embeddings." (EC) or "embedding_bags." (EBC).
    parts = key.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] in ("embeddings", "embedding_bags"):
        return parts[-2]
    return None


def load_full_weights(module: nn.Module, full_weights: Mapping[str, torch.Tensor]) -> None:
    """Copy one full tensor per table into an unsharded EC/EBC."""
    seen = set()
    with torch.no_grad():
        for key, tensor in module.state_dict().items():
            table = _table_of_key(key)
            if table is None:
                continue
            if table not in full_weights:
                raise HarnessError(f"no full weight given for table {table!r}")
            _check_full_shape(table, full_weights[table], tuple(tensor.shape))
            tensor.copy_(full_weights[table])
            seen.add(table)
    extra = sorted(set(full_weights) - seen)
    if extra:
        raise HarnessError(f"full weights given for tables the module does not have: {extra}")


def unsharded_full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        table: tensor.detach().clone()
        for key, tensor in module.state_dict().items()
        if (table := _table_of_key(key)) is not None
    }


def _check_full_shape(table: str, full: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(full.shape) != shape:
        raise HarnessError(f"table {table!r}: full weight has shape {tuple(full.shape)}, the module expects {shape}")


# ---------------------------------------------------------------- plans


def normalize_plan_entry(table: str, entry: Any) -> tuple:
    """("column_wise", ranks) etc. as a tuple of (kind, *args); a clear error names the table at fault."""
    if isinstance(entry, str):
        entry = (entry,)
    if not isinstance(entry, (tuple, list)) or not entry or entry[0] not in PLAN_KINDS:
        raise HarnessError(f"plan entry for table {table!r} is {entry!r}; expected (kind, ...) with kind in {list(PLAN_KINDS)}")
    kind, args = entry[0], tuple(entry[1:])
    if len(args) != PLAN_KINDS[kind]:
        raise HarnessError(f"plan entry for table {table!r}: {kind} takes {PLAN_KINDS[kind]} argument(s), got {args!r}")
    if kind == "column_wise":
        ranks = tuple(int(r) for r in args[0])
        if not ranks:
            raise HarnessError(f"plan entry for table {table!r}: column_wise needs at least one rank")
        return (kind, ranks)
    return (kind, *(int(a) for a in args))


def validate_plan(tables: Sequence[TableSpec], plan: Mapping[str, Any], world_size: int) -> dict[str, tuple]:
    """The plan with every entry normalised; raises HarnessError naming the table or rank at fault."""
    names = [t.name for t in tables]
    missing = [n for n in names if n not in plan]
    unknown = [n for n in plan if n not in names]
    if missing or unknown:
        raise HarnessError(f"plan does not match the tables: missing {missing}, unknown {unknown}")
    normalized = {}
    for table in tables:
        entry = normalize_plan_entry(table.name, plan[table.name])
        kind = entry[0]
        ranks = entry[1] if kind == "column_wise" else (entry[1],) if kind == "table_wise" else ()
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise HarnessError(f"plan entry for table {table.name!r}: rank(s) {bad} outside world size {world_size}")
        if kind == "column_wise" and table.embedding_dim % len(ranks):
            raise HarnessError(
                f"plan entry for table {table.name!r}: embedding_dim {table.embedding_dim} "
                f"is not divisible into {len(ranks)} column-wise shards"
            )
        normalized[table.name] = entry
    return normalized


def describe_plan(plan: Mapping[str, Any]) -> str:
    """A compact, replayable rendering: {'t0': column_wise(0,1,0), 't1': table_wise(1)}."""
    parts = []
    for table, entry in plan.items():
        kind, *args = normalize_plan_entry(table, entry)
        rendered = ",".join(str(a) for a in (args[0] if kind == "column_wise" else args))
        parts.append(f"{table!r}: {kind}({rendered})")
    return "{" + ", ".join(parts) + "}"


def _parameter_sharding_generator(entry: tuple, compute_kernel: str):
    from torchrec.distributed import sharding_plan as sp

    kind, *args = entry
    if kind == "column_wise":
        return sp.column_wise(ranks=list(args[0]), compute_kernel=compute_kernel)
    if kind == "table_wise":
        return sp.table_wise(rank=args[0], compute_kernel=compute_kernel)
    if kind == "row_wise":
        return sp.row_wise(compute_kernel=compute_kernel)
    if kind == "table_row_wise":
        # torchrec's table_row_wise takes no kernel; it picks one itself.
        return sp.table_row_wise(host_index=args[0])
    return sp.data_parallel()


def _sharder_for(module: nn.Module, fused_params: dict[str, Any]):
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(module, EmbeddingCollection):
        return EmbeddingCollectionSharder(fused_params=fused_params)
    if isinstance(module, EmbeddingBagCollection):
        return EmbeddingBagCollectionSharder(fused_params=fused_params)
    raise HarnessError(f"shard_module handles EmbeddingCollection and EmbeddingBagCollection, got {type(module).__name__}")


def build_sharding_plan(module: nn.Module, plan: Mapping[str, Any], *, device: str, compute_kernel: str, world_size: int):
    """torchrec's EmbeddingModuleShardingPlan for ``plan``, built with its sharding_plan helpers."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    generators = {
        table: _parameter_sharding_generator(normalize_plan_entry(table, entry), compute_kernel)
        for table, entry in plan.items()
    }
    # One host: every rank is local, which is what table_row_wise(host_index=0) spreads over.
    return construct_module_sharding_plan(
        module, generators, world_size=world_size, local_size=world_size, device_type=torch.device(device).type
    )


def shard_module(
    module: nn.Module,
    plan: Mapping[str, Any],
    *,
    device: str = "cpu",
    compute_kernel: str = "fused",
    learning_rate: float = 0.1,
) -> nn.Module:
    """Shard an EC/EBC with an explicit per-table plan, inside a rank with the default process group.

    Fused kernels train with EXACT_SGD at ``learning_rate`` inside backward.
    """
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.shard import shard
    from torchrec.distributed.types import ShardingEnv

    if not dist.is_initialized():
        raise HarnessError("shard_module must run inside a rank with the default process group initialised")
    sharder = _sharder_for(module, {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": learning_rate})
    module_plan = build_sharding_plan(
        module, plan, device=device, compute_kernel=compute_kernel, world_size=dist.get_world_size()
    )
    return shard(
        module, module_plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device(device), sharder=sharder
    )


def compute_kernels(device: str, sharding_type: str, module: str = "ec") -> tuple[str, ...]:
    """The compute kernels torchrec's sharding_plan helpers accept for a sharding type on a device.

    That is dense for every type, plus what the module's sharder advertises (fused on CPU; the UVM
    and key-value kernels on CUDA). Kernels that need storage this harness does not set up
    (key_value, virtual tables) are left out.
    """
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    sharder = {"ec": EmbeddingCollectionSharder, "ebc": EmbeddingBagCollectionSharder}[module]()
    device_type = torch.device(device).type
    offered = ["dense"] + list(sharder.compute_kernels(sharding_type, device_type))
    usable = ("dense", "fused", "fused_uvm", "fused_uvm_caching")
    return tuple(k for k in dict.fromkeys(offered) if k in usable)


# ---------------------------------------------------------------- weights of sharded modules


def _local_pieces(sharded: nn.Module) -> list[tuple[str, tuple[int, int], torch.Tensor, bool]]:
    """(table, (row offset, column offset), local tensor, replicated) for every piece on this rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    pieces = []
    for key, value in sharded.state_dict().items():
        table = _table_of_key(key)
        if table is None:
            continue
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                offsets = shard.metadata.shard_offsets
                pieces.append((table, (offsets[0], offsets[1]), shard.tensor, False))
        elif isinstance(value, DTensor):
            raise HarnessError(f"table {table!r}: DTensor state (output_dtensor) is not supported by paritykit yet")
        else:
            pieces.append((table, (0, 0), value, True))
    return pieces


def _global_shapes(sharded: nn.Module) -> dict[str, tuple[int, int]]:
    return {
        table: tuple(value.shape)
        for key, value in sharded.state_dict().items()
        if (table := _table_of_key(key)) is not None
    }


def copy_full_weights_into(sharded: nn.Module, full_weights: Mapping[str, torch.Tensor]) -> None:
    """Copy each table's full tensor into this rank's local shards (every rank calls it)."""
    shapes = _global_shapes(sharded)
    missing = sorted(set(shapes) - set(full_weights))
    if missing:
        raise HarnessError(f"no full weight given for table(s) {missing}")
    for table, shape in shapes.items():
        _check_full_shape(table, full_weights[table], shape)
    with torch.no_grad():
        for table, (row, col), local, _ in _local_pieces(sharded):
            rows, cols = local.shape
            local.copy_(full_weights[table][row : row + rows, col : col + cols])


def gather_full_weights(sharded: nn.Module) -> dict[str, torch.Tensor]:
    """Put every table back together from the shards on all ranks; every rank gets the full tensors.

    Raises ParityError when the shards do not tile a table exactly once, or when the replicas of a
    data-parallel table differ between ranks.
    """
    import torch.distributed as dist

    local = [(t, off, x.detach().cpu().clone(), rep) for t, off, x, rep in _local_pieces(sharded)]
    shapes = _global_shapes(sharded)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, local)

    full = {t: torch.zeros(shape) for t, shape in shapes.items()}
    coverage = {t: torch.zeros(shape, dtype=torch.int32) for t, shape in shapes.items()}
    replicas: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rank, pieces in enumerate(per_rank):
        for table, (row, col), tensor, replicated in pieces:
            if replicated:
                replicas.setdefault(table, []).append((rank, tensor))
                continue
            rows, cols = tensor.shape
            full[table][row : row + rows, col : col + cols] = tensor
            coverage[table][row : row + rows, col : col + cols] += 1
    for table, copies in replicas.items():
        first_rank, first = copies[0]
        for rank, tensor in copies[1:]:
            if not torch.equal(tensor, first):
                index = tuple(int(i) for i in (tensor != first).nonzero()[0])
                raise ParityError(
                    f"data-parallel table {table!r}: replica on rank {rank} differs from rank {first_rank} "
                    f"at {list(index)}: {tensor[index].item()!r} != {first[index].item()!r}"
                )
        full[table] = first.clone()
        coverage[table] += 1
    for table, count in coverage.items():
        if not bool((count == 1).all()):
            index = tuple(int(i) for i in (count != 1).nonzero()[0])
            raise ParityError(
                f"table {table!r}: element {list(index)} is held by {int(count[index])} shard(s) across ranks, expected 1"
            )
    return full


def sgd_step_dense_parameters(sharded: nn.Module, learning_rate: float) -> int:
    """Plain SGD on every real parameter that got a gradient (dense kernels, data-parallel tables).

    Fused kernels have already stepped inside backward; their weights carry no gradient. Returns how
    many parameters were stepped.
    """
    # The sharded modules re-expose weights as TableBatchedEmbeddingSlice views of one TBE tensor per
    # group; a slice's .grad is a view of that tensor's .grad, and setting one slice's .grad to None
    # clears the gradient of every table in the group. So read every gradient first, step, then clear.
    params: list[tuple[nn.Parameter, torch.Tensor]] = []
    seen: set[int] = set()
    for submodule in sharded.modules():
        for param in submodule._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            if param.grad is not None:
                params.append((param, param.grad))
    with torch.no_grad():
        for param, grad in params:
            param.add_(grad, alpha=-learning_rate)
        for param, _ in params:
            param.grad = None
    return len(params)


# ---------------------------------------------------------------- inputs


def kjt_from_rows(
    keys: Sequence[str],
    rows: Mapping[str, Sequence[Sequence[int]]],
    weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    device: str = "cpu",
):
    """A KeyedJaggedTensor from per-feature lists of rows of ids (every feature the same batch size)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch_sizes = {k: len(rows[k]) for k in keys if k in rows}
    missing = [k for k in keys if k not in rows]
    if missing:
        raise HarnessError(f"no rows given for feature(s) {missing}")
    if len(set(batch_sizes.values())) > 1:
        raise HarnessError(f"features have different batch sizes: {batch_sizes}")
    values, lengths, flat_weights = [], [], []
    for key in keys:
        for row_index, row in enumerate(rows[key]):
            values.extend(int(v) for v in row)
            lengths.append(len(row))
            if weights is not None:
                row_weights = weights[key][row_index]
                if len(row_weights) != len(row):
                    raise HarnessError(f"feature {key!r} row {row_index}: {len(row_weights)} weights for {len(row)} ids")
                flat_weights.extend(float(w) for w in row_weights)
    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.tensor(values, dtype=torch.int64, device=device),
        lengths=torch.tensor(lengths, dtype=torch.int32, device=device),
        weights=torch.tensor(flat_weights, dtype=torch.float32, device=device) if weights is not None else None,
    )
