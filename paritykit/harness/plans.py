"""The one plan type: per-table placements, normalised, validated, described and handed to torchrec.

    plan = {"t0": ("column_wise", (0, 1, 0)), "t1": ("table_wise", 1), "t2": ("row_wise",),
            "t3": ("table_row_wise", 0), "t4": ("data_parallel",), "t5": ("column_wise_sized", (4, 8))}
    validate_plan(tables, plan, world_size)     # normalised; HarnessError naming the table or rank
    describe_plan(plan)                         # "{'t0': column_wise(0,1,0), 't1': table_wise(1)}"
    module_sharding_plan(module, plan, ...)     # torchrec's EmbeddingModuleShardingPlan
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError
from paritykit.harness.hosts import host_layout, ranks_per_host_of_this_launch

# Plan entry kinds (torchrec's sharding type names) and the number of arguments each takes.
PLAN_KINDS = {
    "column_wise": 1,
    # Column shards of the given widths, shard i on rank i: torchrec's column_wise(size_per_rank=widths).
    "column_wise_sized": 1,
    "table_column_wise": 1,
    "table_wise": 1,
    "row_wise": 0,
    "table_row_wise": 1,
    "grid_shard": 1,
    "data_parallel": 0,
}
# Kinds whose argument is a sequence of ranks (or host indexes) rather than one number.
_SEQUENCE_ARGUMENT = ("column_wise", "column_wise_sized", "table_column_wise", "grid_shard")


def normalize_plan_entry(table: str, entry: Any) -> tuple:
    """("column_wise", ranks) etc. as a tuple of (kind, *args); a clear error names the table at fault."""
    if isinstance(entry, str):
        entry = (entry,)
    if not isinstance(entry, (tuple, list)) or not entry or entry[0] not in PLAN_KINDS:
        raise HarnessError(f"plan entry for table {table!r} is {entry!r}; expected (kind, ...) with kind in {list(PLAN_KINDS)}")
    kind, args = entry[0], tuple(entry[1:])
    if len(args) != PLAN_KINDS[kind]:
        raise HarnessError(f"plan entry for table {table!r}: {kind} takes {PLAN_KINDS[kind]} argument(s), got {args!r}")
    if kind in _SEQUENCE_ARGUMENT:
        ranks = tuple(int(r) for r in args[0])
        if not ranks:
            raise HarnessError(f"plan entry for table {table!r}: {kind} needs at least one rank")
        return (kind, ranks)
    return (kind, *(int(a) for a in args))


def entry_ranks(entry: tuple) -> tuple[int, ...]:
    """The ranks a normalised entry names explicitly (CW shard ranks, the TW rank)."""
    if entry[0] in ("column_wise", "table_column_wise"):
        return entry[1]
    if entry[0] == "column_wise_sized":
        return tuple(range(len(entry[1])))
    if entry[0] == "table_wise":
        return (entry[1],)
    return ()


def validate_plan(tables: Sequence[Any], plan: Mapping[str, Any], world_size: int) -> dict[str, tuple]:
    """The plan with every entry normalised; raises HarnessError naming the table or rank at fault.

    ``tables`` are TableSpecs (anything with ``name`` and ``embedding_dim``).
    """
    names = [t.name for t in tables]
    missing = [n for n in names if n not in plan]
    unknown = [n for n in plan if n not in names]
    if missing or unknown:
        raise HarnessError(f"plan does not match the tables: missing {missing}, unknown {unknown} (tables: {names})")
    normalized = {}
    for table in tables:
        entry = normalize_plan_entry(table.name, plan[table.name])
        bad = [r for r in entry_ranks(entry) if not 0 <= r < world_size]
        if bad:
            raise HarnessError(f"plan entry for table {table.name!r}: rank(s) {bad} outside world size {world_size}")
        if entry[0] in ("column_wise", "table_column_wise") and table.embedding_dim % len(entry[1]):
            raise HarnessError(
                f"plan entry for table {table.name!r}: embedding_dim {table.embedding_dim} "
                f"is not divisible into {len(entry[1])} column-wise shards"
            )
        if entry[0] == "column_wise_sized" and (sum(entry[1]) != table.embedding_dim or min(entry[1]) <= 0):
            raise HarnessError(f"plan entry for table {table.name!r}: column shard widths {list(entry[1])} must be positive "
                               f"and add up to its embedding_dim {table.embedding_dim}")
        normalized[table.name] = entry
    return normalized


ROW_WISE_KINDS = ("row_wise", "table_row_wise")
# Shardings whose output is a reduce-scatter of partial pools (row shards).
ROW_WISE_FAMILY = ROW_WISE_KINDS + ("grid_shard",)


def row_wise_mean_beside_others(tables: Sequence[Any], plan: Mapping[str, Any]) -> bool:
    """A row-wise or table-row-wise MEAN table beside a table placed otherwise: torchrec divides the
    other tables' pooled outputs by their lengths too (a known torchrec defect, EBC only)."""
    row_mean = any(t.pooling == "MEAN" and plan[t.name][0] in ROW_WISE_KINDS for t in tables)
    return row_mean and any(plan[t.name][0] not in ROW_WISE_KINDS for t in tables)


def ebc_row_wise_mean_beside_others(configuration: Any) -> bool:
    """``row_wise_mean_beside_others`` for an EBC configuration (``module``, ``tables``, ``plan``): the
    one predicate of that torchrec defect, whichever check lists it."""
    return configuration.module == "ebc" and row_wise_mean_beside_others(configuration.tables, configuration.plan)


def local_world_size(world_size: int, ranks_per_host: int | None = None) -> int:
    """Ranks per host as torchrec will see them (it groups ranks into hosts for TWRW, TWCW and GRID).

    ``ranks_per_host`` when given: the hosts of the pool the plan is for (validated: it must divide
    ``world_size``). Otherwise this process's launch (a torchrun launch's LOCAL_WORLD_SIZE, or a pool
    rank's) when it is a launch of ``world_size`` ranks, else one host of ``world_size`` ranks.
    """
    if ranks_per_host is not None:
        return host_layout(world_size, ranks_per_host).ranks_per_host
    return ranks_per_host_of_this_launch(world_size) or world_size


def row_shard_sizes(num_embeddings: int, shards: int) -> list[int]:
    """The rows of each of a table's row shards, in shard order: torchrec gives each shard
    ceil(rows / shards) rows in turn, so the last ones can get fewer, or none."""
    block = -(-num_embeddings // shards)
    return [max(0, min(block, num_embeddings - i * block)) for i in range(shards)]


def has_shard_without_rows(tables: Sequence[Any], plan: Mapping[str, Any], world_size: int) -> bool:
    """Whether a row-sharded table has fewer rows than its shards need (a rank can be left none)."""
    return world_size > 1 and any(
        plan[t.name][0] in ROW_WISE_FAMILY and 0 in row_shard_sizes(t.num_embeddings, world_size) for t in tables
    )


def with_rows_for_every_rank(tables: Sequence[Any], plan: Mapping[str, Any], world_size: int) -> tuple:
    """The tables with each row-sharded one grown to a multiple of ``world_size`` rows, so that no rank
    gets an empty shard (fbgemm's CPU kernel refuses one: a known torchrec/fbgemm CPU issue)."""
    return tuple(
        dataclasses.replace(t, num_embeddings=world_size * -(-t.num_embeddings // world_size))
        if plan[t.name][0] in ROW_WISE_FAMILY else t
        for t in tables
    )


def placements_of(sharding_plan: Any) -> dict[tuple[str, str], tuple]:
    """{(module, table): (sharding type, compute kernel, ranks, shards)} of a resolved torchrec
    ShardingPlan, every shard as (offsets, sizes, placement): equal entries hold equal local shards."""
    entries = {}
    for module, tables in sharding_plan.plan.items():
        for table, sharding in tables.items():
            shards = () if sharding.sharding_spec is None else tuple(
                (tuple(s.shard_offsets), tuple(s.shard_sizes), str(s.placement)) for s in sharding.sharding_spec.shards)
            entries[(module, table)] = (sharding.sharding_type, sharding.compute_kernel, tuple(sharding.ranks or ()), shards)
    return entries


def describe_plan(plan: Mapping[str, Any]) -> str:
    """A compact, replayable rendering: {'t0': column_wise(0,1,0), 't1': table_wise(1)}."""
    parts = []
    for table, entry in plan.items():
        kind, *args = normalize_plan_entry(table, entry)
        rendered = ",".join(str(a) for a in (args[0] if kind in _SEQUENCE_ARGUMENT else args))
        parts.append(f"{table!r}: {kind}({rendered})")
    return "{" + ", ".join(parts) + "}"


def parameter_sharding_generator(entry: tuple, compute_kernel: str | None):
    """torchrec's own ``sharding_plan`` generator for a normalised entry (``compute_kernel`` None:
    torchrec chooses, fused for a table that carries an in-backward optimizer)."""
    from torchrec.distributed import sharding_plan as sp

    kind, *args = entry
    if kind == "column_wise":
        return sp.column_wise(ranks=list(args[0]), compute_kernel=compute_kernel)
    if kind == "column_wise_sized":
        if not column_widths_supported():
            raise HarnessError("column_wise_sized needs torchrec's column_wise(size_per_rank=...), which this torchrec lacks")
        return sp.column_wise(size_per_rank=list(args[0]), compute_kernel=compute_kernel)
    if kind == "table_column_wise":
        return table_column_wise(list(args[0]), compute_kernel)
    if kind == "grid_shard":
        return sp.grid_shard(host_indexes=list(args[0]))
    if kind == "table_wise":
        return sp.table_wise(rank=args[0], compute_kernel=compute_kernel)
    if kind == "row_wise":
        return sp.row_wise(compute_kernel=compute_kernel)
    if kind == "table_row_wise":
        # torchrec's table_row_wise takes no kernel; it picks one itself.
        return sp.table_row_wise(host_index=args[0])
    return sp.data_parallel()


def column_widths_supported() -> bool:
    """Whether this torchrec's column_wise helper takes the shards' widths (``size_per_rank``)."""
    from torchrec.distributed import sharding_plan as sp

    return "size_per_rank" in inspect.signature(sp.column_wise).parameters


def table_column_wise(ranks: list[int], compute_kernel: str | None = None):
    """TWCW: column-wise shards on ranks of one host. torchrec's sharding_plan has no helper for it;
    this is its column_wise generator with the sharding type torchrec's TwCw sharding reads."""
    import dataclasses

    from torchrec.distributed import sharding_plan as sp

    column_wise = sp.column_wise(ranks=ranks, compute_kernel=compute_kernel)

    def generator(param, local_size, world_size, device_type, sharder):
        sharding = column_wise(param, local_size, world_size, device_type, sharder)
        return dataclasses.replace(sharding, sharding_type="table_column_wise")

    return generator


def sharder_for(module: nn.Module, fused_params: dict[str, Any] | None = None):
    """torchrec's sharder for an EmbeddingCollection or EmbeddingBagCollection."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if isinstance(module, EmbeddingCollection):
        return EmbeddingCollectionSharder(fused_params=fused_params)
    if isinstance(module, EmbeddingBagCollection):
        return EmbeddingBagCollectionSharder(fused_params=fused_params)
    raise HarnessError(f"paritykit shards EmbeddingCollection and EmbeddingBagCollection, got {type(module).__name__}")


def module_sharding_plan(module: nn.Module, plan: Mapping[str, Any], *, device: str, compute_kernel: str, world_size: int):
    """torchrec's EmbeddingModuleShardingPlan for ``plan``, built with its sharding_plan helpers."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    generators = {
        table: parameter_sharding_generator(normalize_plan_entry(table, entry), compute_kernel)
        for table, entry in plan.items()
    }
    # The hosts torchrec will see: table_row_wise(host_index=0) spreads over the first host's ranks.
    return construct_module_sharding_plan(
        module, generators, world_size=world_size, local_size=local_world_size(world_size), device_type=torch.device(device).type
    )


def implemented_placements(module_kind: str, device: str) -> tuple[str, ...]:
    """Every sharding type torchrec's sharder for "ec"/"ebc" implements (advertised on ``device`` or on
    CUDA: a type advertised for CUDA only still runs on CPU through the same code)."""
    sharder = _sharder_class(module_kind)()
    kinds = list(sharder.sharding_types(torch.device(device).type)) + list(sharder.sharding_types("cuda"))
    return tuple(k for k in dict.fromkeys(kinds) if k in PLAN_KINDS)


def placements_for(module_kind: str, device: str) -> tuple[str, ...]:
    """The sharding types torchrec's sharder for "ec"/"ebc" offers on ``device`` that a plan can express."""
    sharder = _sharder_class(module_kind)()
    return tuple(t for t in sharder.sharding_types(torch.device(device).type) if t in PLAN_KINDS)


def compute_kernels(device: str, sharding_type: str, module_kind: str = "ec") -> tuple[str, ...]:
    """The compute kernels torchrec's sharding_plan helpers accept for a sharding type on a device.

    That is dense for every type, plus what the module's sharder advertises (fused on CPU; the UVM
    and key-value kernels on CUDA). Kernels that need storage this harness does not set up
    (key_value, virtual tables) are left out.
    """
    sharder = _sharder_class(module_kind)()
    offered = ["dense"] + list(sharder.compute_kernels(sharding_type, torch.device(device).type))
    usable = ("dense", "fused", "fused_uvm", "fused_uvm_caching")
    return tuple(k for k in dict.fromkeys(offered) if k in usable)


def _sharder_class(module_kind: str):
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    classes = {"ec": EmbeddingCollectionSharder, "ebc": EmbeddingBagCollectionSharder}
    if module_kind not in classes:
        raise HarnessError(f"module kind must be 'ec' or 'ebc', got {module_kind!r}")
    return classes[module_kind]
