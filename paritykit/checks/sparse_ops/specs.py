"""Inputs of the sparse ops, drawn by hypothesis as structure plus a seed (short, replayable reprs).

A spec says the shape of a KJT, JT or KeyedTensor (keys in any order, samples per key and rank,
row lengths with empty rows and empty keys, zero-sample batches, dtypes, weights or not, how it is
built); ``reference()`` fills in the numbers from the seed in plain Python (values.py) and returns
the reference object (reference.py, reference_keyed.py). paritykit.checks.sparse_ops.build makes
torchrec's object from the reference object.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import strategies as st

from paritykit.checks.sparse_ops.reference import RefJT, RefKJT, cumsum
from paritykit.checks.sparse_ops.reference_keyed import RefKT
from paritykit.checks.sparse_ops.values import FLOAT_DTYPES, INT_DTYPES, LENGTHS_DTYPES, draw_values

KEY_POOL = tuple(f"f{i}" for i in range(10))  # enough for 3 KeyedTensors of 3 keys
# How a jagged tensor is handed to torchrec: its lengths, its offsets, or both.
FORMS = ("lengths", "offsets", "lengths+offsets")
MAX_LENGTH = 4


@dataclass(frozen=True)
class KJTSpec:
    keys: tuple[str, ...]
    lengths: tuple[tuple[int, ...], ...]
    strides: tuple[tuple[int, ...], ...] | None  # VBE: samples per key per rank
    batch_size: int  # fixed batch (ignored with strides)
    weighted: bool
    value_dtype: str
    weight_dtype: str
    lengths_dtype: str
    form: str
    metadata: bool  # length_per_key/offset_per_key handed to the constructor
    seed: int
    inverse_batch: int | None = None  # VBE: inverse indices for an output batch of this size

    def reference(self) -> RefKJT:
        rng = random.Random(self.seed)
        values = tuple(draw_values(rng, self.value_dtype, sum(lens)) for lens in self.lengths)
        weights = tuple(draw_values(rng, self.weight_dtype, sum(lens)) for lens in self.lengths) if self.weighted else None
        inverse = None
        if self.inverse_batch is not None and self.strides is not None:
            inverse = tuple(tuple(rng.randrange(sum(s)) for _ in range(self.inverse_batch)) for s in self.strides)
        return RefKJT(
            keys=self.keys, lengths=self.lengths, values=values, weights=weights,
            value_dtype=self.value_dtype, lengths_dtype=self.lengths_dtype,
            weight_dtype=self.weight_dtype if self.weighted else None,
            strides=self.strides, batch_size=self.batch_size, inverse=inverse,
        )


@dataclass(frozen=True)
class JTSpec:
    lengths: tuple[int, ...]
    weighted: bool
    value_dtype: str
    weight_dtype: str
    lengths_dtype: str
    form: str
    seed: int
    dim: int = 0  # 0: 1-D values; D: (total, D) values (sequence embeddings)

    def reference(self) -> RefJT:
        rng = random.Random(self.seed)
        total = sum(self.lengths)
        values = draw_values(rng, self.value_dtype, total, self.dim)
        weights = draw_values(rng, self.weight_dtype, total) if self.weighted else None
        return RefJT(self.lengths, values, weights, self.value_dtype, self.lengths_dtype,
                     self.weight_dtype if self.weighted else None, self.dim)


@dataclass(frozen=True)
class KTSpec:
    keys: tuple[str, ...]
    dims: tuple[int, ...]
    batch: int
    dtype: str
    seed: int
    key_dim: int = 1

    def reference(self) -> RefKT:
        rng = random.Random(self.seed)
        width = sum(self.dims)
        count, size = (self.batch, width) if self.key_dim == 1 else (width, self.batch)
        return RefKT(self.keys, self.dims, tuple(draw_values(rng, self.dtype, size) for _ in range(count)), self.dtype, self.key_dim)


# --- strategies ----------------------------------------------------------------------------------


def key_names(min_keys: int, max_keys: int) -> st.SearchStrategy[tuple[str, ...]]:
    """Distinct keys in any order."""
    return st.permutations(KEY_POOL).flatmap(lambda pool: st.integers(min_keys, max_keys).map(lambda n: tuple(pool[:n])))


@st.composite
def rows_of(draw: st.DrawFn, samples: int) -> tuple[int, ...]:
    """Row lengths of ``samples`` samples: empty rows often, the whole key empty sometimes."""
    if samples and draw(st.integers(0, 7)) == 0:
        return (0,) * samples
    return tuple(draw(st.lists(st.one_of(st.just(0), st.integers(0, MAX_LENGTH)), min_size=samples, max_size=samples)))


@st.composite
def kjt_specs(
    draw: st.DrawFn,
    *,
    min_keys: int = 1,
    max_keys: int = 5,
    variable: bool | None = None,
    weighted: bool | None = None,
    value_dtypes: tuple[str, ...] = INT_DTYPES,
    weight_dtypes: tuple[str, ...] = ("float32",),
    lengths_dtypes: tuple[str, ...] = LENGTHS_DTYPES,
    max_batch: int = 4,
    batch: int | None = None,
    ranks: int | None = None,
    max_ranks: int = 3,
    inverse_batch: int | None = None,
    inverse: bool | None = None,
) -> KJTSpec:
    """A KJT: a fixed batch (of 0 samples too) or VBE (samples per key per rank, inverse indices sometimes).

    ``batch``, ``ranks``, ``inverse_batch`` pin what KJTs concatenated together must share.
    """
    keys = draw(key_names(min_keys, max_keys))
    vbe = draw(st.booleans()) if variable is None else variable
    strides, size = None, draw(st.integers(0, max_batch)) if batch is None else batch
    if vbe:
        rank_count = ranks or draw(st.integers(1, max_ranks))
        per_rank = st.lists(st.integers(0, max_batch), min_size=rank_count, max_size=rank_count).map(tuple)
        strides, size = tuple(draw(st.lists(per_rank, min_size=len(keys), max_size=len(keys)))), 0
    samples = [sum(s) for s in strides] if strides else [size] * len(keys)
    lengths = tuple(draw(rows_of(n)) for n in samples)
    if inverse_batch is None and vbe and all(samples) and (draw(st.booleans()) if inverse is None else inverse):
        inverse_batch = draw(st.integers(1, max_batch + 1))
    return KJTSpec(
        keys=keys, lengths=lengths, strides=strides, batch_size=size,
        weighted=draw(st.booleans()) if weighted is None else weighted,
        value_dtype=draw(st.sampled_from(value_dtypes)), weight_dtype=draw(st.sampled_from(weight_dtypes)),
        lengths_dtype=draw(st.sampled_from(lengths_dtypes)), form=draw(st.sampled_from(FORMS)),
        metadata=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
        inverse_batch=inverse_batch if vbe and all(samples) else None,
    )


@st.composite
def jt_specs(
    draw: st.DrawFn,
    *,
    min_rows: int = 0,
    max_rows: int = 5,
    weighted: bool | None = None,
    value_dtypes: tuple[str, ...] = INT_DTYPES + FLOAT_DTYPES,
    weight_dtypes: tuple[str, ...] = ("float32",),
    dims: tuple[int, ...] = (0,),
) -> JTSpec:
    samples = draw(st.integers(min_rows, max_rows))
    return JTSpec(
        lengths=draw(rows_of(samples)),
        weighted=draw(st.booleans()) if weighted is None else weighted,
        value_dtype=draw(st.sampled_from(value_dtypes)), weight_dtype=draw(st.sampled_from(weight_dtypes)),
        lengths_dtype=draw(st.sampled_from(LENGTHS_DTYPES)), form=draw(st.sampled_from(FORMS)),
        seed=draw(st.integers(0, 2**31 - 1)), dim=draw(st.sampled_from(dims)),
    )


@st.composite
def kt_lists(
    draw: st.DrawFn, *, max_kts: int = 3, max_keys: int = 3, dtypes: tuple[str, ...] = ("float32",), key_dims: tuple[int, ...] = (1,)
) -> tuple[KTSpec, ...]:
    """1..max_kts KeyedTensors of one batch size and dtype, with distinct keys (several keys each)."""
    count = draw(st.integers(1, max_kts))
    sizes = draw(st.lists(st.integers(1, max_keys), min_size=count, max_size=count))
    keys = draw(st.permutations(KEY_POOL))[: sum(sizes)]
    batch, dtype, key_dim = draw(st.integers(0, 4)), draw(st.sampled_from(dtypes)), draw(st.sampled_from(key_dims))
    specs = []
    for start, size in zip(cumsum(sizes), sizes):
        dims = tuple(draw(st.lists(st.integers(1, 4), min_size=size, max_size=size)))
        specs.append(KTSpec(tuple(keys[start : start + size]), dims, batch, dtype, draw(st.integers(0, 2**31 - 1)), key_dim))
    return tuple(specs)


@st.composite
def groups_of(draw: st.DrawFn, keys: tuple[str, ...], *, each_key_once: bool | None = None) -> tuple[tuple[str, ...], ...]:
    """Groups over ``keys``: every key once in any order and grouping, or keys repeated and left out."""
    once = draw(st.booleans()) if each_key_once is None else each_key_once
    if once:
        order = draw(st.permutations(keys))
        cuts = sorted(draw(st.sets(st.integers(1, max(len(order) - 1, 1)), max_size=len(order) - 1))) if len(order) > 1 else []
        bounds = [0] + cuts + [len(order)]
        return tuple(tuple(order[bounds[i] : bounds[i + 1]]) for i in range(len(bounds) - 1) if bounds[i] < bounds[i + 1])
    group = st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys) + 1).map(tuple)
    return tuple(draw(st.lists(group, min_size=1, max_size=3)))
