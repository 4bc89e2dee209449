"""JaggedTensor ops against the reference.

``jt.accessors`` (the constructor from lengths, offsets or both; values, lengths, offsets,
weights, *_or_none, size_in_bytes), ``jt.empty``, ``jt.empty_like``, ``jt.from_dense``,
``jt.from_dense_lengths``, ``jt.to_dense+to_dense_weights``, ``jt.to_padded_dense+weights``
(desired_length shorter or longer than the rows, or none; padding_value), ``jt.to``, ``jt.copy_``,
``jt.pytree``, ``jt.refusals`` (the constructor's preconditions). Values are ids or floats, 1-D or 2-D (sequence embeddings, as an EC returns them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import build_jt, flat_tensor, torch_dtype
from paritykit.checks.sparse_ops.cases import OpCase, refused_dtype
from paritykit.checks.sparse_ops.expect import expect_array, expect_jt, expect_offsets, expect_value, ints
from paritykit.checks.sparse_ops.reference import (
    Array,
    RefJT,
    jt_from_dense,
    jt_from_dense_lengths,
    jt_to_dense,
    jt_to_dense_weights,
    jt_to_padded_dense,
    jt_to_padded_dense_weights,
)
from paritykit.checks.sparse_ops.rules import jt_padding_drawable
from paritykit.checks.sparse_ops.specs import JTSpec, jt_specs
from paritykit.checks.sparse_ops.values import FLOAT_DTYPES, INT_DTYPES, draw_values
from paritykit.errors import ParityError

ALL = INT_DTYPES + FLOAT_DTYPES
# fbgemm's CPU jagged_to_padded_dense has no float64 version: pinned cases show it (unsupported).
PADDED_DTYPES = INT_DTYPES + ("float16", "float32")
# Padding values exact in every dtype (integers for id values).
PADDINGS = (0.0, -1.0, 7.0, 0.5, -2.25)

PINNED_JT = JTSpec((2, 0, 3, 1), True, "float32", "float32", "int64", "lengths", 21)
PINNED_JT_2D = JTSpec((1, 3, 0), False, "float16", "float32", "int32", "offsets", 22, dim=3)
PINNED_JT_IDS = JTSpec((0, 4, 1), True, "int64", "float16", "int32", "lengths+offsets", 23)
PINNED_JTS = (PINNED_JT, PINNED_JT_2D, PINNED_JT_IDS)


def _accessors(spec: JTSpec) -> None:
    ref = spec.reference()
    jt = build_jt(ref, spec.form)
    expect_value(jt.lengths_or_none() is not None, "lengths" in spec.form, "jt.lengths_or_none() is not None")
    expect_value(jt.offsets_or_none() is not None, "offsets" in spec.form, "jt.offsets_or_none() is not None")
    expect_jt(jt, ref, "jt")
    # Computed once, kept: "if not computed, return None" (a recomputation is a host read on a GPU).
    expect_value(jt.lengths_or_none() is jt.lengths(), True, "jt.lengths_or_none() is jt.lengths() once computed")
    expect_value(jt.offsets_or_none() is jt.offsets(), True, "jt.offsets_or_none() is jt.offsets() once computed")
    if ref.weights is not None:
        expect_array(jt.weights(), Array((len(ref.weights),), ref.weights, ref.weight_dtype), "jt.weights()")
    sizes = {"int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8}
    expected = len(ref.values) * max(ref.dim, 1) * sizes[ref.value_dtype] + 2 * len(ref.lengths) * sizes[ref.lengths_dtype]
    expected += sizes[ref.lengths_dtype] + (len(ref.weights) * sizes[ref.weight_dtype] if ref.weights is not None else 0)
    expect_value(jt.size_in_bytes(), expected, "jt.size_in_bytes() (after lengths() and offsets())")


def _empty(spec: JTSpec) -> None:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    weight_dtype = spec.weight_dtype if spec.weighted else None
    jt = JaggedTensor.empty(is_weighted=spec.weighted, values_dtype=torch_dtype(spec.value_dtype),
                            weights_dtype=torch_dtype(spec.weight_dtype), lengths_dtype=torch_dtype(spec.lengths_dtype))
    expect_jt(jt, RefJT((), (), () if spec.weighted else None, spec.value_dtype, spec.lengths_dtype, weight_dtype), "JaggedTensor.empty(...)")
    ref = spec.reference()
    like = JaggedTensor.empty_like(build_jt(ref, spec.form))
    expected = RefJT((), (), () if spec.weighted else None, spec.value_dtype, spec.lengths_dtype, weight_dtype, spec.dim)
    # "the same dtypes" is what empty_like promises; a 2-D values tensor comes back 1-D and empty.
    expect_value((like.values().numel(), like.values().dtype), (0, torch_dtype(spec.value_dtype)), "JaggedTensor.empty_like(jt).values() size and dtype")
    expect_array(like.lengths(), ints((), spec.lengths_dtype), "JaggedTensor.empty_like(jt).lengths()")
    expect_offsets(like.offsets(), (), "JaggedTensor.empty_like(jt).offsets()")
    expect_array(like.weights_or_none(), None if expected.weights is None else Array((0,), (), weight_dtype), "JaggedTensor.empty_like(jt).weights_or_none()")
    source = build_jt(ref, spec.form)
    moved = JaggedTensor.empty_like(source, device=source.device())
    for name in ("values", "lengths_or_none", "offsets_or_none", "weights_or_none"):
        a, b = getattr(source, name)(), getattr(moved, name)()
        expect_value(None if b is None else (tuple(b.shape), b.dtype), None if a is None else (tuple(a.shape), a.dtype),
                     f"JaggedTensor.empty_like(jt, device).{name}() shape and dtype")


def _from_dense(spec: JTSpec) -> None:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    ref = spec.reference()
    rows = [flat_tensor(row, ref.value_dtype, ref.dim) for row in ref.rows()]
    weight_rows = None if ref.weights is None else [flat_tensor(row, ref.weight_dtype) for row in ref.weight_rows()]
    jt = JaggedTensor.from_dense(values=rows, weights=weight_rows)
    expected = jt_from_dense(ref.rows(), ref.weight_rows(), ref.value_dtype, ref.weight_dtype, ref.dim)
    expect_jt(jt, expected, f"JaggedTensor.from_dense({len(rows)} rows)")


@dataclass(frozen=True)
class FromDenseLengths:
    jt: JTSpec
    width: int  # N of the dense (B, N) input, at least the longest row


def _from_dense_lengths(spec: FromDenseLengths) -> None:
    """Entries past each row's length are junk the op must leave out."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    ref = spec.jt.reference()
    rng = random.Random(spec.jt.seed + 1)
    pad = lambda rows, dtype, dim: [tuple(row) + draw_values(rng, dtype, spec.width - len(row), dim) for row in rows]  # noqa: E731
    dense = pad(ref.rows(), ref.value_dtype, ref.dim)
    dense_weights = None if ref.weights is None else pad(ref.weight_rows(), ref.weight_dtype, 0)
    shape = (len(dense), spec.width) + ((ref.dim,) if ref.dim else ())
    as_tensor = lambda rows, dtype, dim: flat_tensor([x for row in rows for x in row], dtype, dim).reshape(shape if dim else shape[:2])  # noqa: E731
    jt = JaggedTensor.from_dense_lengths(
        values=as_tensor(dense, ref.value_dtype, ref.dim),
        lengths=torch.tensor(list(ref.lengths), dtype=torch_dtype(ref.lengths_dtype)),
        weights=None if dense_weights is None else as_tensor(dense_weights, ref.weight_dtype, 0),
    )
    expected = jt_from_dense_lengths(dense, ref.lengths, dense_weights, ref.value_dtype, ref.lengths_dtype, ref.weight_dtype)
    expect_jt(jt, replace(expected, dim=ref.dim), f"JaggedTensor.from_dense_lengths(({', '.join(map(str, shape))}) values)")


def _to_dense(spec: JTSpec) -> None:
    ref = spec.reference()
    jt = build_jt(ref, spec.form)
    for name, actual, expected in (("to_dense", jt.to_dense(), jt_to_dense(ref)), ("to_dense_weights", jt.to_dense_weights(), jt_to_dense_weights(ref))):
        if expected is None or actual is None:
            expect_value(actual is None, expected is None, f"jt.{name}() is None")
            continue
        expect_value(len(actual), len(expected), f"len(jt.{name}())")
        for b, (row, want) in enumerate(zip(actual, expected)):
            expect_array(row, want, f"jt.{name}()[{b}]")


@dataclass(frozen=True)
class Padded:
    jt: JTSpec
    desired_length: int | None
    padding_value: float | None  # None: not passed, the signature's default (0.0) pads


# What to_padded_dense(_weights) pad with when no padding_value is given (their signatures' default).
DEFAULT_PADDING = 0.0


def _padding_for(dtype: str | None, value: float) -> float | int:
    return int(value) if dtype in INT_DTYPES else value


def _padded(spec: Padded) -> None:
    ref = spec.jt.reference()
    jt = build_jt(ref, spec.jt.form)
    given = {} if spec.padding_value is None else {"padding_value": spec.padding_value}
    padding = DEFAULT_PADDING if spec.padding_value is None else spec.padding_value
    call = f"to_padded_dense(desired_length={spec.desired_length}" + "".join(f", {k}={v}" for k, v in given.items()) + ")"
    dense = refused_dtype(lambda: jt.to_padded_dense(spec.desired_length, **given), f"jt.to_padded_dense of {ref.value_dtype}")
    expect_array(dense, jt_to_padded_dense(ref, spec.desired_length, _padding_for(ref.value_dtype, padding)), f"jt.{call}")
    weights = refused_dtype(lambda: jt.to_padded_dense_weights(spec.desired_length, **given), f"jt.to_padded_dense_weights of {ref.weight_dtype}")
    expect_array(weights, jt_to_padded_dense_weights(ref, spec.desired_length, padding), f"jt.{call.replace('dense', 'dense_weights')}")


@st.composite
def _paddeds(draw: st.DrawFn) -> Padded:
    spec = draw(jt_specs(value_dtypes=PADDED_DTYPES, weight_dtypes=("float16", "float32"), dims=(0, 0, 2)))
    longest = max(spec.lengths, default=0)
    desired = draw(st.one_of(st.none(), st.integers(0, longest + 2)))
    padding = draw(st.sampled_from(PADDINGS if spec.value_dtype not in INT_DTYPES else PADDINGS[:3]))
    return Padded(spec, desired, padding)


def _move_copy_pytree(spec: JTSpec) -> None:
    from torch.utils import _pytree as pytree

    ref = spec.reference()
    jt = build_jt(ref, spec.form)
    expect_jt(jt.to(jt.device(), non_blocking=True), ref, "jt.to(device, non_blocking=True)")
    target = build_jt(replace(spec, seed=spec.seed + 1).reference(), spec.form)
    expect_jt(target.copy_(jt), ref, "target.copy_(jt)")
    leaves, tree = pytree.tree_flatten(build_jt(ref, spec.form))
    expect_jt(pytree.tree_unflatten(leaves, tree), ref, "tree_unflatten(tree_flatten(jt))")


def _refusals(spec: JTSpec) -> dict[str, int]:
    """The constructor's preconditions: lengths or offsets given, and of an integer type."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    jt = build_jt(spec.reference(), spec.form)
    wrong = {"float lengths": lambda: JaggedTensor(jt.values(), lengths=jt.lengths().float()),
             "float offsets": lambda: JaggedTensor(jt.values(), offsets=jt.offsets().float()),
             "neither lengths nor offsets": lambda: JaggedTensor(jt.values())}
    for what, build in wrong.items():
        try:
            build()
        except (AssertionError, ValueError, TypeError, RuntimeError):
            continue
        raise ParityError(f"JaggedTensor(...) with {what} was accepted (lengths {jt.lengths().tolist()})")
    return {"refusals": len(wrong)}


def jt_cases() -> list[OpCase]:
    specs = jt_specs(value_dtypes=ALL, weight_dtypes=FLOAT_DTYPES, dims=(0, 0, 2))
    widths = specs.flatmap(lambda s: st.builds(FromDenseLengths, st.just(s), st.integers(max(s.lengths, default=0), max(s.lengths, default=0) + 2)))
    float64 = replace(PINNED_JT, value_dtype="float64", weight_dtype="float64")
    pinned_padded = (Padded(PINNED_JT, 2, -1.0), Padded(PINNED_JT, 5, 0.5), Padded(PINNED_JT_2D, None, 7.0),
                     Padded(PINNED_JT_IDS, 1, 7.0), Padded(float64, 2, 0.5), Padded(PINNED_JT, 5, None))
    return [
        OpCase("jt.accessors", specs, _accessors, PINNED_JTS),
        OpCase("jt.empty+empty_like", specs, _empty, PINNED_JTS),
        # from_dense of no rows at all has no tensor to take a dtype from (torch.cat of nothing): not drawn.
        OpCase("jt.from_dense", specs.filter(lambda s: s.lengths), _from_dense, PINNED_JTS),
        OpCase("jt.from_dense_lengths", widths, _from_dense_lengths, tuple(FromDenseLengths(s, 5) for s in PINNED_JTS)),
        OpCase("jt.to_dense+to_dense_weights", specs, _to_dense, PINNED_JTS),
        OpCase("jt.to_padded_dense+weights", _paddeds().filter(lambda p: jt_padding_drawable(p.jt, p.desired_length)), _padded, pinned_padded),
        OpCase("jt.to+copy_+pytree", specs, _move_copy_pytree, PINNED_JTS),
        # An empty float lengths tensor has no element to be of the wrong type: drawn with rows only.
        OpCase("jt.refusals", specs.filter(lambda s: s.lengths), _refusals, PINNED_JTS),
    ]



