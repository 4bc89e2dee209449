"""What a JaggedTensor and a KeyedJaggedTensor mean, in plain Python (no torch, torchrec or fbgemm).

A ``RefJT`` is one feature: a row of values per sample. A ``RefKJT`` is several features (keys),
each with its own rows; with a variable batch (VBE) each key has its own number of samples per
rank (``strides[key][rank]``, samples of rank 0 first). Values are whatever the lists hold: numbers
for the comparisons, or position tags for the gradients (paritykit.checks.sparse_ops.gradients), so
every op here only moves elements and never computes with them.

The ops of JaggedTensor and KeyedJaggedTensor are functions of these (``kjt_permute``,
``jt_to_padded_dense``, ...), each written from the op's meaning as torchrec documents it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


def cumsum(numbers: list[int] | tuple[int, ...]) -> list[int]:
    """[0, n0, n0+n1, ...]: offsets from lengths."""
    out = [0]
    for n in numbers:
        out.append(out[-1] + n)
    return out


def split_by(items: tuple | list, sizes: list[int] | tuple[int, ...]) -> list[tuple]:
    """``items`` cut into consecutive pieces of ``sizes``."""
    bounds = cumsum(sizes)
    if bounds[-1] != len(items):
        raise ValueError(f"pieces of {list(sizes)} do not cover {len(items)} items")
    return [tuple(items[bounds[i] : bounds[i + 1]]) for i in range(len(sizes))]


@dataclass(frozen=True)
class Array:
    """A dense tensor as the reference sees it: shape, elements in row-major order, dtype (None: any)."""

    shape: tuple[int, ...]
    flat: tuple
    dtype: str | None


@dataclass(frozen=True)
class RefJT:
    """One feature: ``lengths[b]`` values in row b. A value is a number, or a row of ``dim`` numbers."""

    lengths: tuple[int, ...]
    values: tuple
    weights: tuple | None
    value_dtype: str
    lengths_dtype: str | None  # None: any integer dtype (torchrec's choice, not a meaning)
    weight_dtype: str | None = None
    dim: int = 0  # 0: 1-D values; D: values of shape (total, D)

    def offsets(self) -> list[int]:
        return cumsum(self.lengths)

    def rows(self) -> list[tuple]:
        return split_by(self.values, self.lengths)

    def weight_rows(self) -> list[tuple] | None:
        return None if self.weights is None else split_by(self.weights, self.lengths)

    def values_array(self) -> Array:
        return _values_array(self.values, self.dim, self.value_dtype)


def _values_array(values: tuple, dim: int, dtype: str) -> Array:
    if dim:
        return Array((len(values), dim), tuple(x for row in values for x in row), dtype)
    return Array((len(values),), tuple(values), dtype)


@dataclass(frozen=True)
class RefKJT:
    """Keys, each with its rows. ``strides`` is None for a fixed batch of ``batch_size`` samples per key.

    ``stride_hint``: the batch size the KJT carries explicitly (torchrec's ``stride=``); a permuted
    or split VBE KJT keeps its parent's. ``inverse``: VBE inverse indices, per key the row of
    each of the output's samples.
    """

    keys: tuple[str, ...]
    lengths: tuple[tuple[int, ...], ...]
    values: tuple[tuple, ...]
    weights: tuple[tuple, ...] | None
    value_dtype: str
    lengths_dtype: str
    weight_dtype: str | None = None
    strides: tuple[tuple[int, ...], ...] | None = None
    batch_size: int = 0
    inverse: tuple[tuple[int, ...], ...] | None = None
    stride_hint: int | None = None

    @property
    def variable(self) -> bool:
        return self.strides is not None

    def stride(self) -> int:
        """The batch size: fixed, or the output batch of a VBE KJT (its inverse indices' width, else
        the largest number of samples of one key)."""
        if not self.variable:
            return self.batch_size
        if self.stride_hint is not None:
            return self.stride_hint
        if self.inverse is not None and self.inverse and self.inverse[0]:
            return len(self.inverse[0])
        return max((sum(s) for s in self.strides), default=0) if self.keys else 0

    def stride_per_key(self) -> list[int]:
        return [sum(s) for s in self.strides] if self.variable else [self.batch_size] * len(self.keys)

    def stride_per_key_per_rank(self) -> list[list[int]]:
        return [list(s) for s in self.strides] if self.variable else []

    def length_per_key(self) -> list[int]:
        return [sum(lens) for lens in self.lengths]

    def offset_per_key(self) -> list[int]:
        return cumsum(self.length_per_key())

    def lengths_offset_per_key(self) -> list[int]:
        return cumsum(self.stride_per_key())

    def flat_lengths(self) -> tuple[int, ...]:
        return tuple(n for lens in self.lengths for n in lens)

    def flat_values(self) -> tuple:
        return tuple(v for vals in self.values for v in vals)

    def flat_weights(self) -> tuple | None:
        return None if self.weights is None else tuple(w for ws in self.weights for w in ws)

    def offsets(self) -> list[int]:
        return cumsum(self.flat_lengths())

    def jt(self, key: str) -> RefJT:
        """The feature ``key`` (the first one of that name)."""
        k = self.keys.index(key)
        return RefJT(self.lengths[k], self.values[k], None if self.weights is None else self.weights[k],
                     self.value_dtype, self.lengths_dtype, self.weight_dtype)

    def select(self, indices: list[int] | tuple[int, ...], **changes: Any) -> "RefKJT":
        """The keys at ``indices`` (repeats allowed), in that order."""
        pick = lambda per_key: tuple(per_key[i] for i in indices)  # noqa: E731
        return replace(
            self,
            keys=pick(self.keys),
            lengths=pick(self.lengths),
            values=pick(self.values),
            weights=None if self.weights is None else pick(self.weights),
            strides=None if self.strides is None else pick(self.strides),
            **changes,
        )


# --- JaggedTensor ops -----------------------------------------------------------------------------


def jt_to_dense(jt: RefJT) -> list[Array]:
    """One tensor per row (``to_dense``)."""
    return [_values_array(row, jt.dim, jt.value_dtype) for row in jt.rows()]


def jt_to_dense_weights(jt: RefJT) -> list[Array] | None:
    rows = jt.weight_rows()
    return None if rows is None else [Array((len(r),), r, jt.weight_dtype) for r in rows]


def padded_width(lengths: tuple[int, ...], desired_length: int | None) -> int:
    """N of ``to_padded_dense``: the requested length, else the longest row."""
    return max(lengths, default=0) if desired_length is None else desired_length


def pad_rows(rows: list[tuple], width: int, padding: Any, dim: int, dtype: str | None) -> Array:
    """(B, width[, dim]): each row cut to ``width`` values, then filled with ``padding``."""
    fill = tuple([padding] * dim) if dim else padding
    flat: list = []
    for row in rows:
        cells = list(row[:width]) + [fill] * max(width - len(row), 0)
        flat.extend(x for cell in cells for x in cell) if dim else flat.extend(cells)
    return Array((len(rows), width) + ((dim,) if dim else ()), tuple(flat), dtype)


def jt_to_padded_dense(jt: RefJT, desired_length: int | None, padding: Any) -> Array:
    return pad_rows(jt.rows(), padded_width(jt.lengths, desired_length), padding, jt.dim, jt.value_dtype)


def jt_to_padded_dense_weights(jt: RefJT, desired_length: int | None, padding: Any) -> Array | None:
    rows = jt.weight_rows()
    if rows is None:
        return None
    return pad_rows(rows, padded_width(jt.lengths, desired_length), padding, 0, jt.weight_dtype)


def jt_from_dense(rows: list[tuple], weight_rows: list[tuple] | None, value_dtype: str, weight_dtype: str | None, dim: int) -> RefJT:
    """``from_dense``: the rows one after the other (the lengths' integer dtype is torchrec's choice)."""
    return RefJT(
        lengths=tuple(len(r) for r in rows),
        values=tuple(v for r in rows for v in r),
        weights=None if weight_rows is None else tuple(w for r in weight_rows for w in r),
        value_dtype=value_dtype, lengths_dtype=None, weight_dtype=weight_dtype, dim=dim,
    )


def jt_from_dense_lengths(dense: list[tuple], lengths: tuple[int, ...], dense_weights: list[tuple] | None,
                          value_dtype: str, lengths_dtype: str, weight_dtype: str | None) -> RefJT:
    """``from_dense_lengths``: the first ``lengths[b]`` entries of each dense row b."""
    return RefJT(
        lengths=lengths,
        values=tuple(v for row, n in zip(dense, lengths) for v in row[:n]),
        weights=None if dense_weights is None else tuple(w for row, n in zip(dense_weights, lengths) for w in row[:n]),
        value_dtype=value_dtype, lengths_dtype=lengths_dtype, weight_dtype=weight_dtype,
    )


# --- KeyedJaggedTensor ops ------------------------------------------------------------------------


def kjt_to_dict(kjt: RefKJT) -> dict[str, RefJT]:
    return {key: kjt.jt(key) for key in kjt.keys}


def kjt_permute(kjt: RefKJT, indices: list[int]) -> RefKJT:
    """Keys in the order of ``indices`` (a key may be taken twice or left out); the batch size stays."""
    return kjt.select(indices, inverse=None, stride_hint=kjt.stride() if kjt.variable else None)


def kjt_split(kjt: RefKJT, segments: list[int]) -> list[RefKJT]:
    """Consecutive pieces of ``segments[i]`` keys each; every piece keeps the whole batch size.

    A piece that is the whole KJT is that KJT (inverse indices included); smaller pieces carry none.
    """
    if sum(segments) != len(kjt.keys):
        raise ValueError(f"segments {segments} do not cover the {len(kjt.keys)} keys")
    pieces, start = [], 0
    for segment in segments:
        if segment == len(kjt.keys):
            pieces.append(kjt)
        else:
            hint = kjt.stride() if kjt.variable else None
            pieces.append(kjt.select(range(start, start + segment), inverse=None, stride_hint=hint))
        start += segment
    return pieces


def kjt_concat(kjts: list[RefKJT]) -> RefKJT:
    """The keys of every KJT, one after the other (one batch size, or VBE for all)."""
    first = kjts[0]
    joined = lambda field: tuple(x for kjt in kjts for x in getattr(kjt, field))  # noqa: E731
    inverse = joined("inverse") if all(k.inverse is not None for k in kjts) else None
    return replace(
        first,
        keys=joined("keys"),
        lengths=joined("lengths"),
        values=joined("values"),
        weights=joined("weights") if first.weights is not None else None,
        strides=joined("strides") if first.variable else None,
        inverse=inverse,
        stride_hint=None,
    )


def kjt_from_jt_dict(jts: dict[str, RefJT], force_variable: bool = False) -> RefKJT:
    """Keys in the dict's order; one batch size when every feature has the same number of rows
    (unless ``force_variable``), else a VBE KJT of one rank."""
    features = list(jts.values())
    sizes = [len(jt.lengths) for jt in features]
    variable = force_variable or len(set(sizes)) > 1
    first = features[0]
    return RefKJT(
        keys=tuple(jts),
        lengths=tuple(jt.lengths for jt in features),
        values=tuple(jt.values for jt in features),
        weights=tuple(jt.weights for jt in features) if first.weights is not None else None,
        value_dtype=first.value_dtype, lengths_dtype=first.lengths_dtype, weight_dtype=first.weight_dtype,
        strides=tuple((n,) for n in sizes) if variable else None,
        batch_size=0 if variable else sizes[0],
    )


def kjt_cast_weights(kjt: RefKJT, dtype: str, cast: Any) -> RefKJT:
    """``to(device, dtype=...)``: the weights take ``dtype`` (``cast`` rounds one number); ids stay."""
    if kjt.weights is None:
        return kjt
    return replace(kjt, weights=tuple(tuple(cast(w) for w in ws) for ws in kjt.weights), weight_dtype=dtype)


# --- what the KJT all-to-all sends and receives ---------------------------------------------------


def sum_by_splits(numbers: list[int], splits: list[int]) -> list[int]:
    return [sum(piece) for piece in split_by(tuple(numbers), splits)]


def kjt_dist_labels(kjt: RefKJT) -> list[str]:
    """The tensors a KJT all-to-all sends, by name."""
    return ["lengths", "values"] + (["strides"] if kjt.variable else []) + (["weights"] if kjt.weights is not None else [])


def kjt_dist_splits(kjt: RefKJT, key_splits: list[int]) -> list[list[int]]:
    """How many of each tensor goes to each destination when destination i takes ``key_splits[i]`` keys."""
    lengths = sum_by_splits(kjt.length_per_key(), key_splits)
    splits = [sum_by_splits(kjt.stride_per_key(), key_splits), lengths]
    return splits + ([list(key_splits)] if kjt.variable else []) + ([lengths] if kjt.weights is not None else [])


def kjt_join_ranks(per_rank: list[RefKJT]) -> RefKJT:
    """The KJT a rank builds from what every rank sent it (``dist_init``): each key's samples of
    rank 0, then rank 1, ...; VBE keeps each rank's sample count per key."""
    first = per_rank[0]
    keys = range(len(first.keys))
    joined = lambda field, k: tuple(x for kjt in per_rank for x in getattr(kjt, field)[k])  # noqa: E731
    return replace(
        first,
        lengths=tuple(joined("lengths", k) for k in keys),
        values=tuple(joined("values", k) for k in keys),
        weights=None if first.weights is None else tuple(joined("weights", k) for k in keys),
        strides=tuple(tuple(kjt.strides[k][0] for kjt in per_rank) for k in keys) if first.variable else None,
        batch_size=0 if first.variable else sum(kjt.batch_size for kjt in per_rank),
        inverse=None, stride_hint=None,
    )
