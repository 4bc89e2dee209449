"""Strategies over a user's own tables: anything with embedding tables (a model, an EBC/EC, a list of
EmbeddingBagConfig/EmbeddingConfig or paritykit TableSpecs) gives batches whose ids stay inside the
smallest table reading each feature, and sharding plans that torchrec's sharders implement."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from paritykit.strategies.sparse import SparseBatch, sparse_batches

# Placements a drawn plan uses; every one is filtered by what the module's sharder implements.
PLAN_KINDS = ("table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "data_parallel")
_ROW_SPLIT = ("row_wise", "table_row_wise")


def _tables(source: Any) -> list[Any]:
    """The table configs of a model or module (every shardable module), or of a list of configs."""
    if isinstance(source, torch.nn.Module):
        from paritykit.harness.inputs import table_configs
        from paritykit.harness.plan_resolution import embedding_modules

        return [config for module in embedding_modules(source).values() for config in table_configs(module)]
    return list(source)


def features_of(source: Any) -> dict[str, int]:
    """Feature -> the number of rows of the smallest table that reads it (ids are drawn below it)."""
    bounds: dict[str, int] = {}
    for table in _tables(source):
        for feature in table.feature_names:
            bounds[feature] = min(bounds.get(feature, table.num_embeddings), table.num_embeddings)
    if not bounds:
        raise ValueError(f"{type(source).__name__} has no embedding table with features")
    return bounds


def batches_for(source: Any, **batch_kwargs: Any) -> st.SearchStrategy[SparseBatch]:
    """SparseBatches over every feature of ``source`` (options as ``sparse_batches``)."""
    bounds = features_of(source)
    return sparse_batches(keys=list(bounds), id_bounds=bounds, **batch_kwargs)


def kjts_for(source: Any, device: str = "cpu", **batch_kwargs: Any) -> st.SearchStrategy[Any]:
    """KJTs over every feature of ``source``, one batch size for all features (what an EBC takes)."""
    batch_kwargs.setdefault("variable_batch", False)
    return batches_for(source, **batch_kwargs).map(lambda batch: batch.to_kjt(device))


def tensordicts_for(source: Any, form: str = "from_jagged_offsets", device: str = "cpu", **batch_kwargs: Any):
    """The TensorDict form of ``kjts_for``'s batches (see paritykit.convert)."""
    batch_kwargs.setdefault("variable_batch", False)
    return batches_for(source, **batch_kwargs).map(lambda batch: batch.to_td(form, device))


@st.composite
def variable_batch_kjts_for(draw: Any, source: Any, max_output_rows: int = 4, **batch_kwargs: Any) -> Any:
    """KJTs with a different batch size per feature and the inverse indices an EBC needs to map every
    output row to a row of each feature (torchrec's variable batch, "VBE")."""
    batch_kwargs.setdefault("offsets_dtypes", (torch.int64,))
    batch = draw(batches_for(source, variable_batch=True, **batch_kwargs))
    rows = draw(st.integers(1, max_output_rows))
    inverse = [draw(st.lists(st.integers(0, size - 1), min_size=rows, max_size=rows)) for size in batch.batch_sizes]
    kjt = batch.to_kjt()
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights_or_none(),
        stride_per_key_per_rank=[[size] for size in batch.batch_sizes],
        inverse_indices=(kjt.keys(), torch.tensor(inverse, dtype=torch.int64)),
    )


@st.composite
def training_batches_for(draw: Any, source: Any, world_size: int, steps: int = 3, **batch_kwargs: Any) -> list[list[Any]]:
    """``batches[step][rank]``: KJTs for ``assert_sharded_matches_unsharded``, one batch size per step on
    every rank (row-wise shards need it on gloo)."""
    bounds = features_of(source)
    max_batch_size = batch_kwargs.pop("max_batch_size", 4)
    # One layout for every rank and step: ranks exchange these tensors, so dtypes must agree.
    batch_kwargs.setdefault("id_dtypes", (draw(st.sampled_from((torch.int32, torch.int64))),))
    batch_kwargs.setdefault("offsets_dtypes", (draw(st.sampled_from((torch.int32, torch.int64))),))
    batch_kwargs.setdefault("weighted", False)
    out = []
    for _ in range(steps):
        size = draw(st.integers(1, max_batch_size))
        batch = sparse_batches(keys=list(bounds), id_bounds=bounds, min_batch_size=size, max_batch_size=size,
                               variable_batch=False, **batch_kwargs)
        out.append([draw(batch).to_kjt() for _ in range(world_size)])
    return out


def _column_splits(dim: int, world_size: int) -> list[int]:
    """Shard counts that cut ``dim`` into equal shards of a multiple of 4 columns (what torchrec's CW needs)."""
    return [k for k in range(2, min(4, world_size * 2) + 1) if dim % k == 0 and (dim // k) % 4 == 0]


def _module_kind(table: Any) -> str:
    """"ec" for a sequence table (torchrec's EmbeddingConfig), else "ebc"."""
    return "ec" if type(table).__name__ == "EmbeddingConfig" else "ebc"


@st.composite
def plans_for(draw: Any, source: Any, world_size: int, kinds: tuple[str, ...] = PLAN_KINDS) -> dict[str, tuple]:
    """{table: placement} (paritykit's short forms, which ``resolve_plan`` takes) for every table of
    ``source``, from the placements its module's sharder implements. Column-wise shards land on ranks in
    any order, repeats included (one shard count for all the column-wise tables of an
    EmbeddingCollection, which needs one shard width). Row-split placements are not drawn for
    MEAN-pooled tables, where torchrec 1.8 computes wrong numbers beside other placements, nor
    data-parallel EmbeddingCollection tables (both listed in the sharding check's known issues)."""
    from paritykit.harness.plans import implemented_placements

    rank = st.integers(0, world_size - 1)
    implemented = {kind: implemented_placements(kind, "cpu") for kind in ("ebc", "ec")}
    ec_shards: list[int] = []
    plan = {}
    for table in _tables(source):
        module = _module_kind(table)
        mean = str(getattr(table, "pooling", "SUM")).endswith("MEAN")
        allowed = [k for k in kinds if k in implemented[module] and not (k in _ROW_SPLIT and mean)
                   and not (module == "ec" and k == "data_parallel")]
        kind = draw(st.sampled_from(allowed or ["table_wise"]))
        splits = _column_splits(table.embedding_dim, world_size)
        if module == "ec" and splits:
            ec_shards = ec_shards or [draw(st.sampled_from(splits))]
            splits = ec_shards
        if kind in ("column_wise", "table_column_wise") and splits:
            plan[table.name] = (kind, tuple(draw(st.lists(rank, min_size=(n := draw(st.sampled_from(splits))), max_size=n))))
        elif kind == "table_row_wise":
            plan[table.name] = (kind, 0)
        elif kind in ("row_wise", "data_parallel"):
            plan[table.name] = (kind,)
        else:
            plan[table.name] = ("table_wise", draw(rank))
    return plan
