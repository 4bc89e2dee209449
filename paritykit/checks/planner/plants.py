"""Planted bugs that the `planner` check must catch: realistic slips in torchrec's planner. Each
changes the plan torchrec makes (tests/test_planner.py shows it on the planner alone first)."""

from __future__ import annotations

from typing import Any, ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "planner"


@register("planner-constraint-widens-sharding-types", check=CHECK)
def planner_constraint_widens_sharding_types() -> ContextManager[Any]:
    """The enumerator joins the user's sharding types with the sharder's (a union for an
    intersection): a table constrained to column-wise may be planned table-wise or data-parallel."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    def planted(original):
        def filter_sharding_types(self, name, allowed_sharding_types, *args, **kwargs):
            constraints = (self._constraints or {}).get(name)
            if constraints is None or not constraints.sharding_types:
                return original(self, name, allowed_sharding_types, *args, **kwargs)
            return sorted(set(constraints.sharding_types) | set(allowed_sharding_types))

        return filter_sharding_types

    return replaced(EmbeddingEnumerator, "_filter_sharding_types", planted)


@register("planner-drops-min-partition", check=CHECK)
def planner_drops_min_partition() -> ContextManager[Any]:
    """The enumerator stops passing the constraint's min_partition on: column-wise tables are cut
    in blocks of the default width (128), one shard for any table narrower than that."""
    import torchrec.distributed.planner.enumerators as enumerators

    def planted(original):
        def calculate_shard_sizes_and_offsets(*args, **kwargs):
            kwargs["col_wise_shard_dim"] = None
            return original(*args, **kwargs)

        return calculate_shard_sizes_and_offsets

    return replaced(enumerators, "calculate_shard_sizes_and_offsets", planted)
