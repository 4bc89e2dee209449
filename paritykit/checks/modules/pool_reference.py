"""What torchrec's object pools keep, in plain Python: the meaning their docstrings give.

``TensorPool(pool_size, dim)``: a [pool_size, dim] table of rows, zeros until updated;
``update(ids, values)`` sets row ``ids[i]`` to ``values[i]`` ("if duplicate ids are passed in for
update, only the last one is kept"); ``lookup(ids)`` returns the rows at ``ids``.

``KeyedJaggedTensorPool(pool_size, feature_max_lengths)``: one sample of a KJT per slot, a list of
values (and weights) per feature of ``feature_max_lengths``, empty until updated. ``update(ids, kjt)``
stores sample ``b`` of ``kjt`` in slot ``ids[b]``, its features taken by name (the KJT's keys may come
in any order and hold keys the pool does not keep); ``lookup(ids)`` returns a KJT of the pool's
features in the pool's order, with one sample per id.
"""

from __future__ import annotations

from typing import Sequence

Entry = tuple[int, float]  # a value and its weight


class TensorPoolModel:
    def __init__(self, pool_size: int, dim: int) -> None:
        self.pool_size, self.dim = pool_size, dim
        self.rows: dict[int, tuple[float, ...]] = {}

    def update(self, ids: Sequence[int], rows: Sequence[Sequence[float]]) -> None:
        for id_, row in zip(ids, rows):  # in order: a later duplicate overwrites an earlier one
            self.rows[id_] = tuple(row)

    def row(self, id_: int) -> tuple[float, ...]:
        return self.rows.get(id_, (0.0,) * self.dim)

    def lookup(self, ids: Sequence[int]) -> list[tuple[float, ...]]:
        return [self.row(id_) for id_ in ids]

    def table(self) -> list[tuple[float, ...]]:
        return [self.row(id_) for id_ in range(self.pool_size)]


class KJTPoolModel:
    def __init__(self, pool_size: int, features: Sequence[str]) -> None:
        self.pool_size, self.features = pool_size, tuple(features)
        self.slots: dict[int, dict[str, tuple[Entry, ...]]] = {}

    def update(self, ids: Sequence[int], samples: Sequence[dict[str, Sequence[Entry]]]) -> None:
        for id_, sample in zip(ids, samples):
            self.slots[id_] = {key: tuple(sample.get(key, ())) for key in self.features}

    def lookup(self, ids: Sequence[int]) -> dict[str, list[tuple[Entry, ...]]]:
        """{feature: [the entries of each id's slot]}, the pool's features in its order."""
        return {key: [self.slots.get(id_, {}).get(key, ()) for id_ in ids] for key in self.features}
