"""KeyedJaggedTensor constructors and accessors against the reference.

- ``kjt.accessors``: the constructor (lengths, offsets or both; with or without length_per_key),
  then every accessor: values, lengths, offsets, weights, *_or_none, keys, stride, stride_per_key,
  stride_per_key_per_rank, variable_stride_per_key, length_per_key, offset_per_key,
  lengths_offset_per_key, index_per_key, inverse_indices, sync/unsync, size_in_bytes.
- ``kjt.from_lengths_sync`` / ``kjt.from_offsets_sync``: the KJT with its metadata computed.
- ``kjt.from_jt_dict``: one KJT from a JaggedTensor per key (VBE when the batch sizes differ; with
  ``force_variable_stride`` where torchrec has it), and the ``ComputeJTDictToKJT`` module.
- ``kjt.empty`` / ``kjt.empty_like``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import build_jt, build_kjt, torch_dtype
from paritykit.checks.sparse_ops.cases import OpCase
from paritykit.checks.sparse_ops.expect import expect_array, expect_inverse, expect_kjt, expect_value, ints
from paritykit.checks.sparse_ops.reference import Array, RefKJT, kjt_from_jt_dict
from paritykit.checks.sparse_ops.rules import OFFSETS_ZERO_BATCH, kept_out, kjt_drawable, zero_batch
from paritykit.checks.sparse_ops.specs import FORMS, KJTSpec, kjt_specs
from paritykit.checks.sparse_ops.values import FLOAT_DTYPES, INT_DTYPES, LENGTHS_DTYPES

ALL_VALUE_DTYPES = INT_DTYPES + FLOAT_DTYPES
ELEMENT_BYTES = {"int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8}

# Pinned: a fixed batch with weights, empty rows and an empty key; a VBE batch of two ranks with
# inverse indices; a batch of no samples.
PINNED_FIXED = KJTSpec(("f2", "f0", "f1"), ((2, 0, 1), (0, 0, 0), (3, 1, 0)), None, 3, True, "int64", "float32",
                       "int32", "lengths", False, 11)
PINNED_VBE = KJTSpec(("f1", "f3", "f0"), ((1, 0, 2), (0, 2, 1, 1, 3), (2, 2)), ((2, 1), (1, 4), (2, 0)), 0, True,
                     "int32", "float32", "int64", "offsets", False, 12, inverse_batch=4)
PINNED_EMPTY_BATCH = KJTSpec(("f0", "f1"), ((), ()), None, 0, False, "int64", "float32", "int64", "lengths", False, 13)
PINNED_KJTS = (PINNED_FIXED, PINNED_VBE, PINNED_EMPTY_BATCH)


def _accessors(spec: KJTSpec) -> None:
    ref = spec.reference()
    # The metadata asked first, before anything computed the lengths from offsets-only input.
    expect_value(build_kjt(ref, spec.form, spec.metadata).length_per_key(), ref.length_per_key(), "kjt.length_per_key() asked first")
    expect_value(build_kjt(ref, spec.form, spec.metadata).offset_per_key(), ref.offset_per_key(), "kjt.offset_per_key() asked first")
    kjt = build_kjt(ref, spec.form, spec.metadata)
    # What was given is there; what was not is computed on demand, not before.
    expect_value(kjt.lengths_or_none() is not None, "lengths" in spec.form, "kjt.lengths_or_none() is not None")
    expect_value(kjt.offsets_or_none() is not None, "offsets" in spec.form, "kjt.offsets_or_none() is not None")
    expect_value(kjt.length_per_key_or_none(), ref.length_per_key() if spec.metadata else None, "kjt.length_per_key_or_none()")
    expect_value(kjt.weights_or_none() is not None, spec.weighted, "kjt.weights_or_none() is not None")
    if not ref.variable:
        expect_value(kjt.size_in_bytes(), _size_in_bytes(ref, spec.form), "kjt.size_in_bytes()")
    expect_kjt(kjt, ref, "kjt")
    # Computed once, kept: "None if not computed yet" (a recomputation is a host read on a GPU).
    for name in ("lengths", "offsets"):
        expect_value(getattr(kjt, f"{name}_or_none")() is getattr(kjt, name)(), True, f"kjt.{name}_or_none() is kjt.{name}() once computed")
    for name in ("length_per_key", "offset_per_key"):
        computed = getattr(kjt, name)()
        expect_value(getattr(kjt, f"{name}_or_none")(), computed, f"kjt.{name}_or_none() once kjt.{name}() computed it")
    if ref.inverse is not None:
        expect_inverse(kjt.inverse_indices(), ref, "kjt (inverse_indices())")
    expect_value(kjt.unsync().length_per_key_or_none(), None, "kjt.unsync().length_per_key_or_none()")
    expect_value(kjt.sync().offset_per_key_or_none(), ref.offset_per_key(), "kjt.sync().offset_per_key_or_none()")
    if ref.weights is not None:
        expect_array(kjt.weights(), Array((len(ref.flat_weights()),), ref.flat_weights(), ref.weight_dtype), "kjt.weights()")


def _size_in_bytes(ref: RefKJT, form: str) -> int:
    count = len(ref.flat_values()) * ELEMENT_BYTES[ref.value_dtype]
    if ref.weights is not None:
        count += len(ref.flat_weights()) * ELEMENT_BYTES[ref.weight_dtype]
    lengths_bytes = ELEMENT_BYTES[ref.lengths_dtype]
    count += len(ref.flat_lengths()) * lengths_bytes if "lengths" in form else 0
    return count + (len(ref.offsets()) * lengths_bytes if "offsets" in form else 0)


def _sync_constructors(spec: KJTSpec) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ref = spec.reference()
    built = build_kjt(ref, "lengths+offsets")
    common = dict(keys=list(ref.keys), values=built.values(), weights=built.weights_or_none())
    if ref.variable:
        common["stride_per_key_per_rank"] = [list(s) for s in ref.strides]
    else:
        common["stride"] = ref.batch_size
    if ref.inverse is not None:
        common["inverse_indices"] = built.inverse_indices()
    constructors = [("from_lengths_sync", lambda: KeyedJaggedTensor.from_lengths_sync(lengths=built.lengths(), **common))]
    if not (zero_batch(spec) and kept_out(OFFSETS_ZERO_BATCH)):  # known-broken case kjt-offsets-zero-batch
        constructors.append(("from_offsets_sync", lambda: KeyedJaggedTensor.from_offsets_sync(offsets=built.offsets(), **common)))
    for name, made in constructors:
        kjt = made()
        expect_value(kjt.length_per_key_or_none(), ref.length_per_key(), f"KeyedJaggedTensor.{name}(...).length_per_key_or_none()")
        expect_kjt(kjt, ref, f"KeyedJaggedTensor.{name}(...)")


@dataclass(frozen=True)
class FromJTDict:
    kjt: KJTSpec  # fixed batch, or VBE of one rank: one JaggedTensor per key
    forms: tuple[str, ...]  # how each JaggedTensor is built


@st.composite
def _from_jt_dict_specs(draw: st.DrawFn) -> FromJTDict:
    spec = draw(kjt_specs(ranks=1, value_dtypes=ALL_VALUE_DTYPES, inverse=False).filter(kjt_drawable))
    return FromJTDict(spec, tuple(draw(st.lists(st.sampled_from(FORMS), min_size=len(spec.keys), max_size=len(spec.keys)))))


def _from_jt_dict(spec: FromJTDict) -> None:
    from torchrec.sparse.jagged_tensor import ComputeJTDictToKJT, KeyedJaggedTensor

    ref = spec.kjt.reference()
    jt_refs = {key: ref.jt(key) for key in ref.keys}
    jts = {key: build_jt(jt, form) for (key, jt), form in zip(jt_refs.items(), spec.forms)}
    expected = kjt_from_jt_dict(jt_refs)
    expect_kjt(KeyedJaggedTensor.from_jt_dict(jts), expected, "KeyedJaggedTensor.from_jt_dict(jts)")
    expect_kjt(ComputeJTDictToKJT()(jts), expected, "ComputeJTDictToKJT()(jts)")
    if "force_variable_stride" in inspect.signature(KeyedJaggedTensor.from_jt_dict).parameters:
        forced = KeyedJaggedTensor.from_jt_dict(jts, force_variable_stride=True)
        expect_kjt(forced, kjt_from_jt_dict(jt_refs, force_variable=True), "KeyedJaggedTensor.from_jt_dict(jts, force_variable_stride=True)")


@dataclass(frozen=True)
class Empty:
    weighted: bool
    value_dtype: str
    weight_dtype: str
    lengths_dtype: str


def _empty(spec: Empty) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.empty(is_weighted=spec.weighted, values_dtype=torch_dtype(spec.value_dtype),
                                  weights_dtype=torch_dtype(spec.weight_dtype), lengths_dtype=torch_dtype(spec.lengths_dtype))
    ref = RefKJT((), (), (), () if spec.weighted else None, spec.value_dtype, spec.lengths_dtype,
                 spec.weight_dtype if spec.weighted else None)
    expect_kjt(kjt, ref, "KeyedJaggedTensor.empty(...)")


def _empty_like(spec: KJTSpec) -> None:
    """Without a device: no keys, the dtypes, and the batch (stride, or VBE strides); with one: the
    same keys, shapes and metadata in new (uninitialised) tensors."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ref = spec.reference()
    kjt = build_kjt(ref, spec.form, spec.metadata)
    empty = KeyedJaggedTensor.empty_like(kjt)
    expect_value(empty.keys(), [], "empty_like(kjt).keys()")
    expect_array(empty.values(), Array((0,), (), ref.value_dtype), "empty_like(kjt).values()")
    expect_array(empty.weights_or_none(), None if ref.weights is None else Array((0,), (), ref.weight_dtype), "empty_like(kjt).weights_or_none()")
    expect_array(empty.lengths(), ints((), ref.lengths_dtype), "empty_like(kjt).lengths()")
    expect_value(empty.variable_stride_per_key(), ref.variable, "empty_like(kjt).variable_stride_per_key()")
    if ref.variable:  # its stride() is 0: no keys (torchrec's rule for a KJT without keys)
        expect_value(empty.stride_per_key_per_rank(), ref.stride_per_key_per_rank(), "empty_like(kjt).stride_per_key_per_rank()")
    else:
        expect_value(empty.stride(), ref.stride(), "empty_like(kjt).stride()")
    moved = KeyedJaggedTensor.empty_like(kjt, device=kjt.device())
    expect_value(moved.keys(), list(ref.keys), "empty_like(kjt, device).keys()")
    for name in ("values", "lengths_or_none", "offsets_or_none", "weights_or_none"):
        source, copy = getattr(kjt, name)(), getattr(moved, name)()
        expect_value(None if copy is None else (tuple(copy.shape), copy.dtype), None if source is None else (tuple(source.shape), source.dtype),
                     f"empty_like(kjt, device).{name}() shape and dtype")
    expect_value(moved.length_per_key_or_none(), ref.length_per_key() if spec.metadata else None, "empty_like(kjt, device).length_per_key_or_none()")
    expect_value(moved.stride_per_key_per_rank(), ref.stride_per_key_per_rank(), "empty_like(kjt, device).stride_per_key_per_rank()")


def kjt_constructor_cases() -> list[OpCase]:
    specs = kjt_specs(value_dtypes=ALL_VALUE_DTYPES, weight_dtypes=FLOAT_DTYPES).filter(kjt_drawable)
    empties = st.builds(Empty, st.booleans(), st.sampled_from(ALL_VALUE_DTYPES), st.sampled_from(FLOAT_DTYPES), st.sampled_from(LENGTHS_DTYPES))
    pinned_jt_dict = tuple(FromJTDict(s, ("lengths", "offsets", "lengths+offsets")[: len(s.keys)]) for s in PINNED_KJTS if not s.inverse_batch)
    return [
        OpCase("kjt.accessors", specs, _accessors, PINNED_KJTS),
        OpCase("kjt.from_lengths_sync+from_offsets_sync", specs, _sync_constructors, PINNED_KJTS),
        OpCase("kjt.from_jt_dict", _from_jt_dict_specs(), _from_jt_dict, pinned_jt_dict),
        OpCase("kjt.empty", empties, _empty, (Empty(True, "int64", "float32", "int32"),)),
        OpCase("kjt.empty_like", specs, _empty_like, PINNED_KJTS),
    ]
