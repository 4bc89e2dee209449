"""A user's sharding plan resolved, before any rank runs, into torchrec's own ``ShardingPlan``.

Accepted forms (every table of every shardable module must be placed):
- a torchrec ``ShardingPlan``;
- ``{table: placement}`` when table names are unique across the model's embedding modules;
- ``{module_fqn: {table: placement}}`` (or ``{module_fqn: EmbeddingModuleShardingPlan}``).
A placement is one of torchrec's ``ParameterShardingGenerator``s (``sharding_plan.table_wise(rank=1)``,
``column_wise(ranks=[1, 0])``, ``row_wise()``, ...), a resolved ``ParameterSharding``, or paritykit's
short form (``("column_wise", (0, 1, 0))``, ``("table_wise", 1)``, ``"row_wise"``, ...).

Resolution needs only the model's parameter shapes, so it runs in the caller: a plan that names a
table the model lacks, leaves one out, puts a shard on a rank outside the world, whose shards
overlap or leave a gap, or whose table-row-wise or grid shards do not lie on one host's ranks, is a
HarnessError naming the table (a user's mistake, never torchrec's refusal).

Hosts: a plan is resolved for the hosts of the ranks it will run on (``local_size``: ranks per
host; give the pool's ``ranks_per_host``), never for the caller's own environment: torchrec's
generators place ``table_row_wise(host_index=1)`` on the second host's ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError, UnsupportedByTorchrec
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.plans import PLAN_KINDS, local_world_size, normalize_plan_entry, parameter_sharding_generator


def embedding_modules(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> every module torchrec's default sharders shard (EBC, EC, feature-processed EBC, ...)."""
    from torchrec.distributed.sharding_plan import get_module_to_default_sharders

    shardable = tuple(get_module_to_default_sharders())
    found: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():
        # Inside a shardable module (the model itself, FQN "", included) its sharder shards everything.
        if isinstance(module, shardable) and not any(outer == "" or fqn.startswith(f"{outer}.") for outer in found):
            found[fqn] = module
    return found


def sharder_of(module: nn.Module):
    from torchrec.distributed.sharding_plan import get_module_to_default_sharders

    sharders = get_module_to_default_sharders()
    return next(sharder for cls, sharder in sharders.items() if type(module) is cls or isinstance(module, cls))


def table_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Table name -> weight shape, for the tables the module's sharder shards."""
    return {name: tuple(param.shape) for name, param in sharder_of(module).shardable_parameters(module).items()}


def resolve_plan(model: nn.Module, plan: Any, *, world_size: int, device_type: str, local_size: int | None = None):
    """torchrec's ShardingPlan for ``plan`` (see the module docstring), validated against ``model``.

    ``local_size``: ranks per host of the ranks that will run it (None: this process's launch, else
    one host; ``paritykit.harness.plans.local_world_size``); HarnessError when it does not divide
    ``world_size``."""
    from torchrec.distributed.types import ShardingPlan

    modules = embedding_modules(model)
    if not modules:
        raise HarnessError(f"{type(model).__name__} has no module torchrec can shard (no EmbeddingBagCollection, EmbeddingCollection, ...)")
    per_module = _per_module(plan.plan if isinstance(plan, ShardingPlan) else plan, modules)
    resolved = {}
    for fqn, module in modules.items():
        entries = per_module.get(fqn)
        if entries is None:
            raise HarnessError(f"the plan places no table of module {fqn!r} (tables {sorted(table_shapes(module))})")
        layout = host_layout(world_size, local_world_size(world_size, local_size))
        resolved[fqn] = _resolve_module(fqn, module, entries, layout, device_type)
    return ShardingPlan(resolved)


def _per_module(plan: Any, modules: dict[str, nn.Module]) -> dict[str, Mapping[str, Any]]:
    if not isinstance(plan, Mapping) or not plan:
        raise HarnessError(f"a plan maps tables (or module FQNs) to placements; got {type(plan).__name__}")
    if all(key in modules for key in plan) and all(isinstance(v, Mapping) for v in plan.values()):
        return {fqn: entries for fqn, entries in plan.items()}
    owner: dict[str, str] = {}
    for fqn, module in modules.items():
        for table in table_shapes(module):
            if table in owner:
                raise HarnessError(
                    f"table {table!r} is in both {owner[table]!r} and {fqn!r}: give the plan per module, "
                    f"{{module_fqn: {{table: placement}}}}"
                )
            owner[table] = fqn
    unknown = sorted(t for t in plan if t not in owner)
    if unknown:
        raise HarnessError(f"the plan names table(s) {unknown} that the model does not have (tables: {sorted(owner)})")
    per_module: dict[str, dict[str, Any]] = {}
    for table, placement in plan.items():
        per_module.setdefault(owner[table], {})[table] = placement
    return per_module


def _resolve_module(fqn: str, module: nn.Module, entries: Mapping[str, Any], layout: HostLayout, device_type: str):
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding

    sharder = sharder_of(module)
    params = sharder.shardable_parameters(module)
    missing, unknown = sorted(set(params) - set(entries)), sorted(set(entries) - set(params))
    if missing or unknown:
        raise HarnessError(f"module {fqn!r}: the plan leaves out table(s) {missing} and names unknown table(s) {unknown}")
    resolved = EmbeddingModuleShardingPlan()
    for table, entry in entries.items():
        placement = _generator(fqn, table, entry)
        where = f"module {fqn!r}, table {table!r}"
        if not isinstance(placement, ParameterSharding):
            # A ParameterShardingGenerator, called as construct_module_sharding_plan calls it.
            try:
                placement = placement(params[table], layout.ranks_per_host, layout.world_size, device_type, sharder)
            except (AssertionError, ValueError, IndexError, KeyError, TypeError) as exc:
                raise HarnessError(f"{where}: the placement cannot be built: {type(exc).__name__}: {exc}") from exc
        validate_parameter_sharding(where, placement, tuple(params[table].shape), layout.world_size)
        validate_hosts(where, placement, layout)
        check_implemented(where, sharder, placement, device_type)
        resolved[table] = placement
    return resolved


def _generator(fqn: str, table: str, entry: Any):
    if callable(entry) or type(entry).__name__ == "ParameterSharding":
        return entry
    if isinstance(entry, str) or (isinstance(entry, (tuple, list)) and entry and entry[0] in PLAN_KINDS):
        return parameter_sharding_generator(normalize_plan_entry(table, entry), compute_kernel=None)
    raise HarnessError(f"module {fqn!r}, table {table!r}: {entry!r} is not a placement (a torchrec sharding_plan "
                       f"generator, a ParameterSharding or one of {list(PLAN_KINDS)})")


def check_implemented(where: str, sharder: Any, sharding: Any, device_type: str) -> None:
    """UnsupportedByTorchrec when torchrec's sharder implements the sharding type or kernel on no device.

    A type torchrec implements but advertises only for CUDA (row-wise EBC, say) runs on CPU and is
    allowed: the code paths are the same.
    """
    implemented = set(sharder.sharding_types(device_type)) | set(sharder.sharding_types("cuda"))
    if sharding.sharding_type not in implemented:
        raise UnsupportedByTorchrec(
            f"{where}: torchrec's {type(sharder).__name__} does not implement {sharding.sharding_type!r} "
            f"(it implements {sorted(implemented)})"
        )
    kernels = {"dense"} | set(sharder.compute_kernels(sharding.sharding_type, device_type))
    if sharding.compute_kernel not in kernels:
        raise UnsupportedByTorchrec(
            f"{where}: torchrec offers no {sharding.compute_kernel!r} kernel for {sharding.sharding_type!r} on "
            f"{device_type} (it offers {sorted(kernels)})"
        )


def validate_parameter_sharding(where: str, sharding: Any, shape: tuple[int, ...], world_size: int) -> None:
    """Ranks inside the world and shards that tile the table exactly once; HarnessError naming the fault."""
    ranks = [r for r in (sharding.ranks or []) if r is not None]
    bad = sorted({r for r in ranks if not 0 <= r < world_size})
    if bad:
        raise HarnessError(f"{where}: placed on rank(s) {bad}, outside world size {world_size}")
    if sharding.sharding_spec is None:
        return
    shards = sharding.sharding_spec.shards
    coverage = torch.zeros(shape, dtype=torch.int32)
    for shard in shards:
        region = tuple(slice(o, o + s) for o, s in zip(shard.shard_offsets, shard.shard_sizes))
        if any(o < 0 or o + s > n for o, s, n in zip(shard.shard_offsets, shard.shard_sizes, shape)):
            raise HarnessError(f"{where}: shard at {list(shard.shard_offsets)} of size {list(shard.shard_sizes)} "
                               f"reaches outside the table's {list(shape)}")
        coverage[region] += 1
    if not bool((coverage == 1).all()):
        index = [int(i) for i in (coverage != 1).nonzero()[0]]
        count = int(coverage[tuple(index)])
        raise HarnessError(f"{where}: element {index} is covered by {count} shards ({'overlap' if count else 'gap'})")


# Sharding types whose row shards torchrec lays on the ranks of one host, in local-rank order: TWRW
# keeps only the first rank and gives shard i to local rank i of that host; GRID combines each column
# block's row shards per host (its output dist reduce-scatters within the host).
_ONE_HOST_ROW_SHARDS = ("table_row_wise", "grid_shard")


def validate_hosts(where: str, sharding: Any, layout: HostLayout) -> None:
    """Table-row-wise shards are one host's ranks in local-rank order; grid shards are blocks of
    ``ranks_per_host`` such ranks, one per column block (a host may hold several). HarnessError
    naming the table, its ranks and the layout otherwise."""
    if sharding.sharding_type not in _ONE_HOST_ROW_SHARDS or not sharding.ranks:
        return
    ranks, size = list(sharding.ranks), layout.ranks_per_host
    blocks = [tuple(ranks[i:i + size]) for i in range(0, len(ranks), size)]
    one_host_each = all(block == layout.ranks_of_host(layout.host_of(block[0])) for block in blocks)
    if not one_host_each or (sharding.sharding_type == "table_row_wise" and len(blocks) != 1):
        raise HarnessError(
            f"{where}: {sharding.sharding_type} shards on ranks {ranks}, but on {layout.describe()} "
            f"{'its' if sharding.sharding_type == 'table_row_wise' else 'each column block of'} {size} row shards must be "
            f"one host's ranks in order (host h: ranks {size}h..{size}h+{size - 1}); "
            "was the plan resolved for other hosts than the ranks it runs on?"
        )
