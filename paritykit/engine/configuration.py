"""A user's model, plan and batches as the plain data a failure carries: one
``paritykit.harness.configuration.ShardedConfiguration`` per sharded embedding module (its tables,
its placements as torchrec resolved them, its batches), built only when something failed. The
known issues are matched against it (``paritykit.checks.known_configurations``).
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.engine.training import TrainingSetup
from paritykit.harness.configuration import RankBatch, ShardedConfiguration
from paritykit.harness.inputs import table_configs
from paritykit.harness.plan_resolution import embedding_modules
from paritykit.harness.plans import local_world_size
from paritykit.harness.tables import TableSpec


def configurations_of(setup: TrainingSetup) -> tuple[ShardedConfiguration, ...]:
    """One configuration per sharded embedding module of ``setup``'s model."""
    model = setup.model_fn()
    found = []
    for fqn, module in embedding_modules(model).items():
        # A feature-processed EBC is an EBC with its inner EBC's tables.
        kind = "ebc" if hasattr(getattr(module, "_embedding_bag_collection", module), "embedding_bag_configs") else "ec"
        configs = table_configs(module)
        tables = tuple(TableSpec(c.name, c.num_embeddings, c.embedding_dim, tuple(c.feature_names),
                                 "MEAN" if kind == "ebc" and c.pooling.name == "MEAN" else "SUM") for c in configs)
        shardings = setup.sharding_plan.plan[fqn]
        features = [f for t in tables for f in t.feature_names]
        found.append(ShardedConfiguration(
            kind, setup.world_size, tables,
            {name: short_placement(sharding, setup.world_size) for name, sharding in shardings.items()},
            {name: sharding.compute_kernel for name, sharding in shardings.items()},
            tuple(tuple(rank_batch(batch, features) for batch in step) for step in setup.batches),
            weighted=bool(getattr(module, "is_weighted", lambda: False)()),
            need_indices=bool(getattr(module, "_need_indices", False)),
            optimizer=setup.embedding_optimizer.name, dense_optimizer=setup.dense_optimizer.name,
            lr=setup.embedding_optimizer.lr, device=torch.device(setup.device).type, fqn=fqn, ranks_per_host=setup.ranks_per_host,
            source=f"{getattr(setup.model_fn, '__qualname__', 'a model')} sharded over {setup.world_size} ranks"))
    return tuple(found)


def short_placement(sharding: Any, world_size: int) -> tuple:
    """paritykit's short form of a resolved ParameterSharding ("column_wise", (1, 0)), ("row_wise",), ..."""
    kind, ranks = sharding.sharding_type, [r for r in (sharding.ranks or []) if r is not None]
    local = local_world_size(world_size)
    if kind == "column_wise":
        widths = [shard.shard_sizes[1] for shard in sorted(sharding.sharding_spec.shards, key=lambda s: s.shard_offsets[1])]
        if len(set(widths)) > 1 and ranks == list(range(len(ranks))):  # column_wise(size_per_rank=widths)
            return ("column_wise_sized", tuple(widths))
        return (kind, tuple(ranks))
    if kind == "table_column_wise":
        return (kind, tuple(ranks))
    if kind == "table_wise":
        return (kind, ranks[0] if ranks else 0)
    if kind == "table_row_wise":
        return (kind, ranks[0] // local if ranks else 0)
    if kind == "grid_shard":
        return (kind, tuple(sorted({rank // local for rank in ranks})) or (0,))
    return (kind,)


def rank_batch(batch: Any, features: list[str]) -> RankBatch:
    """The ids (and weights, and inverse indices) of the module's features in one rank's batch; an
    empty batch when no KeyedJaggedTensor in it holds them."""
    kjt = _find_kjt(batch, set(features))
    if kjt is None:
        return RankBatch(())
    by_key = kjt.to_dict()
    keys = [k for k in kjt.keys() if k in set(features)]
    ids = tuple((k, tuple(tuple(int(v) for v in row.tolist()) for row in by_key[k].to_dense())) for k in keys)
    weights = None
    if kjt.weights_or_none() is not None:
        weights = tuple((k, tuple(tuple(float(w) for w in row.tolist()) for row in by_key[k].to_dense_weights())) for k in keys)
    inverse = kjt.inverse_indices_or_none() if kjt.variable_stride_per_key() else None
    if inverse is not None:
        names, indices = inverse
        inverse = tuple((k, tuple(int(i) for i in indices[names.index(k)].tolist())) for k in keys if k in names)
    return RankBatch(ids, weights, inverse or None)


def _find_kjt(value: Any, features: set[str], depth: int = 0):
    if type(value).__name__ == "KeyedJaggedTensor":
        return value if features & set(value.keys()) else None
    if depth > 3:
        return None
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple)):
        children = list(value)
    else:
        children = [v for k, v in vars(value).items() if not k.startswith("__")] if hasattr(value, "__dict__") else []
    for child in children:
        found = _find_kjt(child, features, depth + 1)
        if found is not None:
            return found
    return None
