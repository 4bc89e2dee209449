"""EmbeddingCollection lookups and ``construct_jagged_tensors`` against a hand computation of their meaning.

- ``ec.lookup``: an unsharded ``EmbeddingCollection`` whose tables serve one or several features
  each (a table shared by features) and features served by two tables (``feature@table`` outputs),
  ``need_indices`` on or off, against the lookups by hand: per lookup, the feature's rows with each
  id replaced by the table's row (and, with ``need_indices``, the ids as the JaggedTensor's weights).
- ``construct_jagged_tensors`` (torchrec/modules/utils.py): the sharded EC's output builder, called
  as the sharded EC calls it for column-wise shards: the features with a key once per shard (the
  same rows), each shard's embeddings one after the other, a shard order
  (``features_to_permute_indices``), ``need_indices``; against the reference: per feature its
  lengths, the shards' columns joined in shard order, its ids.

Lookups only copy numbers (float32 rows drawn exactly representable), so everything is bit for bit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import build_kjt, flat_tensor
from paritykit.checks.sparse_ops.cases import OpCase
from paritykit.checks.sparse_ops.expect import expect_jt, expect_value
from paritykit.checks.sparse_ops.kjt_cases import PINNED_FIXED
from paritykit.checks.sparse_ops.reference import RefJT, RefKJT
from paritykit.checks.sparse_ops.rules import CONSTRUCT_ZERO_BATCH, kept_out, kjt_drawable, zero_batch
from paritykit.checks.sparse_ops.specs import KJTSpec, kjt_specs
from paritykit.checks.sparse_ops.values import draw_values

MAX_SHARDS = 3


@dataclass(frozen=True)
class LookupSpec:
    kjt: KJTSpec  # a fixed batch of ids
    tables_of_key: tuple[tuple[int, ...], ...]  # per key, the tables that serve it (several: a shared feature)
    rows: tuple[int, ...]  # per table, num_embeddings (a key's ids are taken modulo its smallest table)
    dim: int
    need_indices: bool
    seed: int

    def output_name(self, key: str, table: int) -> str:
        """torchrec's name of a lookup: the feature, or ``feature@table`` when several tables serve it."""
        return f"{key}@t{table}" if len(self.tables_of_key[self.kjt.keys.index(key)]) > 1 else key


def _ids_in_tables(spec: LookupSpec) -> RefKJT:
    ref = spec.kjt.reference()
    bounds = [min(spec.rows[t] for t in tables) for tables in spec.tables_of_key]
    return replace(ref, values=tuple(tuple(i % bound for i in ids) for ids, bound in zip(ref.values, bounds)))


def _feature_jt(ref: RefKJT, k: int, rows_of_ids: tuple, dim: int, need_indices: bool) -> RefJT:
    """Feature k with each id's embedding as its value (and its ids as weights with need_indices)."""
    return RefJT(ref.lengths[k], rows_of_ids, ref.values[k] if need_indices else None, "float32", ref.lengths_dtype,
                 ref.value_dtype if need_indices else None, dim)


def _lookup(spec: LookupSpec) -> dict[str, Any]:
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    ref = _ids_in_tables(spec)
    rng = random.Random(spec.seed)
    weights = [draw_values(rng, "float32", rows, spec.dim) for rows in spec.rows]
    configs = [EmbeddingConfig(name=f"t{t}", embedding_dim=spec.dim, num_embeddings=rows,
                               feature_names=[key for key, tables in zip(ref.keys, spec.tables_of_key) if t in tables])
               for t, rows in enumerate(spec.rows)]
    ec = EmbeddingCollection(tables=configs, need_indices=spec.need_indices)
    with torch.no_grad():
        for t, table in enumerate(weights):
            ec.embeddings[f"t{t}"].weight.copy_(flat_tensor(table, "float32", spec.dim))
    out = ec(build_kjt(ref, spec.kjt.form, spec.kjt.metadata))
    names = {spec.output_name(key, t): (k, t) for k, key in enumerate(ref.keys) for t in spec.tables_of_key[k]}
    expect_value(sorted(out), sorted(names), "sorted(EmbeddingCollection(...)(kjt))")
    for name, (k, t) in names.items():
        expect_jt(out[name], _feature_jt(ref, k, tuple(weights[t][i] for i in ref.values[k]), spec.dim, spec.need_indices),
                  f"EmbeddingCollection(need_indices={spec.need_indices})(kjt)[{name!r}] (table t{t})")
    return {"lookups": len(names), "tables": len(spec.rows)}


@st.composite
def _lookup_specs(draw: st.DrawFn) -> LookupSpec:
    kjt = draw(kjt_specs(variable=False, weighted=False).filter(lambda s: kjt_drawable(s, to_dict=True)))
    count = draw(st.integers(1, len(kjt.keys) + 1))
    owners = [draw(st.sets(st.integers(0, count - 1), min_size=1, max_size=2)) for _ in kjt.keys]
    used = sorted(set().union(*owners))  # tables renumbered: none left without a feature
    tables_of_key = tuple(tuple(sorted(used.index(t) for t in tables)) for tables in owners)
    rows = tuple(draw(st.lists(st.integers(1, 9), min_size=len(used), max_size=len(used))))
    return LookupSpec(kjt, tables_of_key, rows, draw(st.integers(1, 4)), draw(st.booleans()), draw(st.integers(0, 2**31 - 1)))


@dataclass(frozen=True)
class ConstructSpec:
    kjt: KJTSpec  # a fixed batch of ids, distinct keys
    shards: tuple[int, ...]  # per key, its column shards
    order: tuple[tuple[int, ...] | None, ...]  # per key, the shard order (features_to_permute_indices) or None
    dim: int  # columns per shard
    need_indices: bool
    seed: int


def _construct(spec: ConstructSpec) -> dict[str, Any]:
    from torchrec.modules.utils import construct_jagged_tensors

    ref = spec.kjt.reference()
    positions = [k for k, count in enumerate(spec.shards) for _ in range(count)]  # a key once per shard
    features = ref.select(positions)
    rng = random.Random(spec.seed)
    pieces = [draw_values(rng, "float32", len(features.values[p]), spec.dim) for p in range(len(positions))]
    embeddings = flat_tensor(tuple(row for piece in pieces for row in piece), "float32", spec.dim).reshape(-1, spec.dim)
    permute = {ref.keys[k]: list(order) for k, order in enumerate(spec.order) if order is not None}
    out = construct_jagged_tensors(embeddings=embeddings, features=build_kjt(features, spec.kjt.form), embedding_names=list(features.keys),
                                   need_indices=spec.need_indices, features_to_permute_indices=permute or None)
    expect_value(sorted(out), sorted(ref.keys), "sorted(construct_jagged_tensors(...))")
    for k, key in enumerate(ref.keys):
        mine = [p for p, owner in enumerate(positions) if owner == k]
        ordered = [mine[i] for i in (spec.order[k] or range(len(mine)))]
        joined = tuple(tuple(x for p in ordered for x in pieces[p][j]) for j in range(len(ref.values[k])))
        expect_jt(out[key], _feature_jt(ref, k, joined, spec.dim * len(mine), spec.need_indices),
                  f"construct_jagged_tensors(shards {spec.shards}, order {spec.order}, need_indices={spec.need_indices})[{key!r}]")
    return {"features": len(ref.keys), "shards": len(positions)}


@st.composite
def _construct_specs(draw: st.DrawFn) -> ConstructSpec:
    kjt = draw(kjt_specs(variable=False, weighted=False).filter(lambda s: kjt_drawable(s, to_dict=True)
                                                                   and not (zero_batch(s) and kept_out(CONSTRUCT_ZERO_BATCH))))
    shards = tuple(draw(st.lists(st.integers(1, MAX_SHARDS), min_size=len(kjt.keys), max_size=len(kjt.keys))))
    order = tuple(draw(st.none() | st.permutations(range(n)).map(tuple)) for n in shards)
    return ConstructSpec(kjt, shards, order, draw(st.integers(1, 3)), draw(st.booleans()), draw(st.integers(0, 2**31 - 1)))


UNWEIGHTED = replace(PINNED_FIXED, weighted=False)
PINNED_LOOKUPS = (LookupSpec(UNWEIGHTED, ((0,), (0, 1), (1,)), (5, 3), 3, True, 61), LookupSpec(UNWEIGHTED, ((0,), (0,), (0,)), (7,), 2, False, 62))
PINNED_CONSTRUCTS = (ConstructSpec(UNWEIGHTED, (2, 1, 3), ((1, 0), None, (2, 0, 1)), 2, True, 63),)


def embedding_cases() -> list[OpCase]:
    return [OpCase("ec.lookup", _lookup_specs(), _lookup, PINNED_LOOKUPS),
            OpCase("construct_jagged_tensors", _construct_specs(), _construct, PINNED_CONSTRUCTS)]


def construct_zero_batch() -> None:
    """Known broken: features with keys and a batch of no samples (``lengths.view(-1, 0)``)."""
    no_samples = KJTSpec(("f0", "f1"), ((), ()), None, 0, False, "int64", "float32", "int64", "lengths", False, 64)
    _construct(ConstructSpec(no_samples, (2, 1), ((1, 0), None), 2, True, 65))
