"""What a KeyedTensor means, in plain Python: dense per-key blocks side by side along the key dim.

``RefKT.rows`` is the values tensor as a list of rows. With ``key_dim`` 1 (pooled embeddings: one
row per sample) key k owns ``dims[k]`` consecutive columns; with ``key_dim`` 0 it owns that many
consecutive rows. Regrouping (``regroup``, ``regroup_as_dict``, ``KTRegroupAsDict``,
``permute_multi_embedding``, ``regroup_kts``) means: for each group, the blocks of its keys (taken
from whichever KeyedTensor holds each key) laid side by side along the key dim, in the group's order.
"""

from __future__ import annotations

from dataclasses import dataclass

from paritykit.checks.sparse_ops.reference import Array, cumsum


@dataclass(frozen=True)
class RefKT:
    keys: tuple[str, ...]
    dims: tuple[int, ...]
    rows: tuple[tuple, ...]
    dtype: str
    key_dim: int = 1

    @property
    def batch(self) -> int:
        """Samples: rows when the keys lie along columns, columns otherwise."""
        if self.key_dim == 1:
            return len(self.rows)
        return len(self.rows[0]) if self.rows else 0

    def offset_per_key(self) -> list[int]:
        return cumsum(self.dims)

    def block(self, key: str) -> list[tuple]:
        """The rows of ``key``'s block (a (batch, dim) block for key_dim 1, (dim, batch) for 0)."""
        k = self.keys.index(key)
        start, stop = self.offset_per_key()[k], self.offset_per_key()[k + 1]
        if self.key_dim == 1:
            return [row[start:stop] for row in self.rows]
        return list(self.rows[start:stop])

    def values_array(self) -> Array:
        return _array(list(self.rows), self.batch, sum(self.dims), self.key_dim, self.dtype)


def _array(rows: list[tuple], batch: int, width: int, key_dim: int, dtype: str | None) -> Array:
    shape = (batch, width) if key_dim == 1 else (width, batch)
    return Array(shape, tuple(x for row in rows for x in row), dtype)


def side_by_side(blocks: list[list[tuple]], batch: int, key_dim: int) -> list[tuple]:
    """Blocks joined along the key dim: columns appended (key_dim 1) or rows appended (key_dim 0)."""
    if key_dim == 1:
        return [tuple(x for block in blocks for x in block[b]) for b in range(batch)]
    return [row for block in blocks for row in block]


def kt_getitem(kt: RefKT, key: str) -> Array:
    dim = kt.dims[kt.keys.index(key)]
    return _array(kt.block(key), kt.batch, dim, kt.key_dim, kt.dtype)


def kt_to_dict(kt: RefKT) -> dict[str, Array]:
    return {key: kt_getitem(kt, key) for key in kt.keys}


def kt_from_blocks(keys: tuple[str, ...], blocks: list[list[tuple]], dims: tuple[int, ...], batch: int,
                   key_dim: int, dtype: str) -> RefKT:
    """``KeyedTensor.from_tensor_list``: the blocks joined along the key dim."""
    return RefKT(keys, dims, tuple(side_by_side(blocks, batch, key_dim)), dtype, key_dim)


def kt_regroup(kts: list[RefKT], groups: list[list[str]]) -> list[Array]:
    """One tensor per group: its keys' blocks side by side, each key from the KeyedTensor holding it."""
    holder = {key: kt for kt in kts for key in kt.keys}
    first = kts[0]
    out = []
    for group in groups:
        blocks = [holder[key].block(key) for key in group]
        width = sum(holder[key].dims[holder[key].keys.index(key)] for key in group)
        out.append(_array(side_by_side(blocks, first.batch, first.key_dim), first.batch, width, first.key_dim, first.dtype))
    return out


def kt_regroup_as_dict(kts: list[RefKT], groups: list[list[str]], names: list[str]) -> dict[str, Array]:
    return dict(zip(names, kt_regroup(kts, groups)))
