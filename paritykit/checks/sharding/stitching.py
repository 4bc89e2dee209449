"""Column-wise shard-order math: the oracle for how CW shard outputs go back together.

A column-wise table is cut into shards 0..n-1 (left to right); shard i lives on rank ``ranks[i]``.
After the output all-to-all the shard outputs arrive grouped by rank, in rank order, and, within
one rank, in shard order. When a rank holds several shards of a table, arrival order is not shard
order: ranks [0, 1, 0] deliver shards [0, 2, 1]. ``cw_permute_indices(ranks)[i]`` is the arrival
position of shard i, so concatenating ``arrived[p] for p in cw_permute_indices(ranks)`` restores
the full embedding.

Everything here is derived from that description alone. ``torchrec_feature_permute_indices`` asks
torchrec's ShardedEmbeddingCollection for its own answer so the two can be compared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def _check_ranks(ranks: Sequence[int]) -> list[int]:
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ValueError("a column-wise table needs at least one shard rank")
    negative = [i for i, r in enumerate(ranks) if r < 0]
    if negative:
        raise ValueError(f"shard rank must be >= 0; shard {negative[0]} has rank {ranks[negative[0]]}")
    return ranks


def arrival_order(ranks: Sequence[int]) -> list[int]:
    """The shard indices in the order their outputs arrive: grouped by rank, rank order, stable."""
    ranks = _check_ranks(ranks)
    return sorted(range(len(ranks)), key=lambda shard: (ranks[shard], shard))


def cw_permute_indices(ranks: Sequence[int]) -> list[int]:
    """For each shard in shard order, the position at which its output arrives.

    >>> cw_permute_indices([0, 1, 0])
    [0, 2, 1]
    """
    positions = [0] * len(_check_ranks(ranks))
    for position, shard in enumerate(arrival_order(ranks)):
        positions[shard] = position
    return positions


def column_slices(embedding_dim: int, num_shards: int) -> list[tuple[int, int]]:
    """(offset, width) of each shard when ``embedding_dim`` columns are cut into equal shards."""
    if num_shards < 1 or embedding_dim % num_shards:
        raise ValueError(f"cannot cut {embedding_dim} columns into {num_shards} equal column-wise shards")
    width = embedding_dim // num_shards
    return [(i * width, width) for i in range(num_shards)]


def split_columns(full: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    """The shards of a full-width tensor (last dimension), in shard order."""
    return [full[..., offset : offset + width] for offset, width in column_slices(full.shape[-1], num_shards)]


def arrange_in_arrival_order(shards: Sequence[torch.Tensor], ranks: Sequence[int]) -> list[torch.Tensor]:
    """What the output all-to-all delivers: the shard outputs reordered by rank."""
    if len(shards) != len(ranks):
        raise ValueError(f"{len(shards)} shard outputs for {len(ranks)} shard ranks")
    return [shards[shard] for shard in arrival_order(ranks)]


def stitch(arrived: Sequence[torch.Tensor], ranks: Sequence[int]) -> torch.Tensor:
    """Concatenate shard outputs received in arrival order back into full width."""
    if len(arrived) != len(ranks):
        raise ValueError(f"{len(arrived)} arrived shard outputs for {len(ranks)} shard ranks")
    return torch.cat([arrived[position] for position in cw_permute_indices(ranks)], dim=-1)


def output_names(tables: Sequence[Any]) -> dict[tuple[str, str], str]:
    """(table, feature) -> the output key: the feature name, or ``feature@table`` when tables share it."""
    counts: dict[str, int] = {}
    for table in tables:
        for feature in table.feature_names:
            counts[feature] = counts.get(feature, 0) + 1
    return {
        (table.name, feature): feature if counts[feature] == 1 else f"{feature}@{table.name}"
        for table in tables
        for feature in table.feature_names
    }


def expected_feature_permute_indices(tables: Sequence[Any], plan: Mapping[str, Any]) -> dict[str, list[int]]:
    """Output key -> cw_permute_indices of its table's shard ranks, for every column-wise table.

    ``tables`` are paritykit.harness.tables.TableSpec (anything with name and feature_names); ``plan`` maps a
    table name to ("column_wise", ranks) or another placement.
    """
    names = output_names(tables)
    result: dict[str, list[int]] = {}
    for table in tables:
        entry = plan[table.name]
        if entry[0] != "column_wise":
            continue
        for feature in table.feature_names:
            result[names[(table.name, feature)]] = cw_permute_indices(entry[1])
    return result


def shard_ranks_in_column_order(parameter_sharding: Any) -> list[int]:
    """The ranks of a column-wise table's shards, left to right (torchrec's ParameterSharding)."""
    shards = sorted(parameter_sharding.sharding_spec.shards, key=lambda shard: shard.shard_offsets[1])
    return [int(str(shard.placement).split("rank:")[1].split("/")[0]) for shard in shards]


def permutations_of_plan(tables: Sequence[Any], module_plan: Mapping[str, Any]) -> dict[str, list[int]]:
    """What ``expected_feature_permute_indices`` says for a resolved torchrec module plan."""
    plan = {
        table.name: ("column_wise", tuple(shard_ranks_in_column_order(module_plan[table.name])))
        if module_plan[table.name].sharding_type == "column_wise" else ("other",)
        for table in tables
    }
    return expected_feature_permute_indices(tables, plan)


def torchrec_feature_permute_indices(module: torch.nn.Module, module_plan: Mapping[str, Any]) -> dict[str, list[int]]:
    """The per-feature CW permutation torchrec's ShardedEmbeddingCollection derives for a plan.

    Calls torchrec's own ``_generate_permute_indices_per_feature`` with the unsharded EC's configs
    and the materialised plan (torchrec's ParameterSharding per table); no process group needed.
    """
    from types import SimpleNamespace

    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    holder = SimpleNamespace(_features_to_permute_indices={})
    ShardedEmbeddingCollection._generate_permute_indices_per_feature(
        holder, module.embedding_configs(), dict(module_plan)
    )
    return {key: list(value) for key, value in holder._features_to_permute_indices.items()}


def sharded_cw_permutations(dmp: torch.nn.Module) -> dict[str, dict[str, list[int]]]:
    """A probe for the ranks: torchrec's per-feature CW permutation of every sharded EC in ``dmp``."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    from paritykit.harness.dmp import canonical_name

    return {
        canonical_name(name): {key: list(value) for key, value in module._features_to_permute_indices.items()}
        for name, module in dmp.named_modules()
        if isinstance(module, ShardedEmbeddingCollection)
    }
