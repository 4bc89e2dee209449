"""Embedding tables described by a small spec, their seeded weights, and the unsharded EC/EBC.

    tables = (TableSpec("t0", num_embeddings=10, embedding_dim=8, feature_names=("f0", "f1")), ...)
    ec  = build_ec(tables, seed=0, need_indices=False)       # EmbeddingCollection
    ebc = build_ebc(tables, seed=0, is_weighted=False)       # EmbeddingBagCollection (TableSpec.pooling)
    full = seeded_full_weights(tables, seed=0)               # {table: tensor}, what build_* loads
    kjt = kjt_from_rows(("f0", "f1"), {"f0": [[1, 2], []], "f1": [[], [3]]})

Weights are deterministic functions of (seed, table name), so every rank and the parent build the
same numbers without communicating.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError
from paritykit.harness.seeding import generator

POOLINGS = ("SUM", "MEAN")


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
    return torch.randn(table.num_embeddings, table.embedding_dim, generator=generator("table", seed, table.name))


def seeded_full_weights(tables: Sequence[TableSpec], seed: int) -> dict[str, torch.Tensor]:
    return {t.name: seeded_table_weight(t, seed) for t in tables}


def build_ec(tables: Sequence[TableSpec], *, seed: int, need_indices: bool = False, device: str = "cpu", **options: Any) -> nn.Module:
    """An unsharded EmbeddingCollection with ``seeded_full_weights(tables, seed)`` loaded; ``options``:
    more of EmbeddingCollection's own arguments."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    configs = [
        EmbeddingConfig(
            name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim, feature_names=list(t.feature_names)
        )
        for t in tables
    ]
    module = EmbeddingCollection(tables=configs, device=torch.device(device), need_indices=need_indices, **options)
    load_full_weights(module, seeded_full_weights(tables, seed))
    return module


def build_ebc(tables: Sequence[TableSpec], *, seed: int, is_weighted: bool = False, device: str = "cpu",
              init_bounds: Mapping[str, tuple[float, float]] | None = None) -> nn.Module:
    """An unsharded EmbeddingBagCollection with ``seeded_full_weights(tables, seed)`` loaded. ``init_bounds``
    (table -> (weight_init_min, weight_init_max)) goes into the tables' configs, for the modules made from them."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.feature_names),
            pooling=PoolingType[t.pooling],
            **dict(zip(("weight_init_min", "weight_init_max"), (init_bounds or {}).get(t.name, ()))),
        )
        for t in tables
    ]
    module = EmbeddingBagCollection(tables=configs, is_weighted=is_weighted, device=torch.device(device))
    load_full_weights(module, seeded_full_weights(tables, seed))
    return module


def table_of_key(key: str) -> str | None:
    """The table a state-dict key belongs to, or None for anything that is not an embedding weight.

    torchrec names a table's weight ``...embeddings.<table>.weight`` (EC) or
    ``...embedding_bags.<table>.weight`` (EBC), sharded or not.
    """
    parts = key.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] in ("embeddings", "embedding_bags"):
        return parts[-2]
    return None


def check_full_shape(table: str, full: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(full.shape) != tuple(shape):
        raise HarnessError(f"table {table!r}: full weight has shape {tuple(full.shape)}, the module expects {tuple(shape)}")


def load_full_weights(module: nn.Module, full_weights: Mapping[str, torch.Tensor]) -> None:
    """Copy one full tensor per table into an unsharded module's embedding tables."""
    seen = set()
    with torch.no_grad():
        for key, tensor in module.state_dict().items():
            table = table_of_key(key)
            if table is None:
                continue
            if table not in full_weights:
                raise HarnessError(f"no full weight given for table {table!r}")
            check_full_shape(table, full_weights[table], tuple(tensor.shape))
            tensor.copy_(full_weights[table])
            seen.add(table)
    extra = sorted(set(full_weights) - seen)
    if extra:
        raise HarnessError(f"full weights given for tables the module does not have: {extra}")


def unsharded_full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """{table: a copy of its weight} of an unsharded module."""
    return {
        table: tensor.detach().clone()
        for key, tensor in module.state_dict().items()
        if (table := table_of_key(key)) is not None
    }


def kjt_from_rows(
    keys: Sequence[str],
    rows: Mapping[str, Sequence[Sequence[int]]],
    weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    device: str = "cpu",
):
    """A KeyedJaggedTensor from per-feature lists of rows of ids (every feature the same batch size)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    missing = [k for k in keys if k not in rows]
    if missing:
        raise HarnessError(f"no rows given for feature(s) {missing}")
    batch_sizes = {k: len(rows[k]) for k in keys}
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
