"""KeyedJaggedTensor ops that move ids and weights, against the reference.

``kjt.split``, ``kjt.permute`` (a key taken twice or left out, indices tensor given or not),
``kjt.to_dict`` (and ``ComputeKJTToJTDict``, ``compute_offsets=False``), ``kjt.getitem``,
``kjt.flatten_lengths``, ``kjt.concat``, ``kjt.to`` (dtype casts the weights only), ``kjt.copy_``,
``kjt.pytree`` (flatten and unflatten, as torch.export and dynamo take a KJT apart),
``kjt.clear_storage`` (what the training pipeline frees early).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import build_kjt, torch_dtype
from paritykit.checks.sparse_ops.cases import OpCase, refused_dtype
from paritykit.checks.sparse_ops.expect import expect_jt, expect_kjt, expect_value
from paritykit.checks.sparse_ops.kjt_cases import PINNED_FIXED, PINNED_KJTS, PINNED_VBE
from paritykit.checks.sparse_ops.reference import kjt_cast_weights, kjt_concat, kjt_permute, kjt_split, kjt_to_dict
from paritykit.checks.sparse_ops.rules import kjt_drawable
from paritykit.checks.sparse_ops.specs import KJTSpec, kjt_specs
from paritykit.checks.sparse_ops.values import FLOAT_DTYPES, INT_DTYPES, round_to

ALL_VALUE_DTYPES = INT_DTYPES + FLOAT_DTYPES
NO_KEYS = KJTSpec((), (), None, 3, False, "int64", "float32", "int64", "lengths", False, 61)
# fbgemm's CPU permute kernels have no float64 values version (permute_2D/1D_sparse_data), and the
# VBE one (permute_1D_sparse_data) no float16 weights version; pinned cases show both (reported
# unsupported, with fbgemm's words, while they last), the draws leave them out.
PERMUTE_VALUE_DTYPES = INT_DTYPES + ("float16", "float32")


def vbe_permute_takes(spec: KJTSpec) -> bool:
    return not (spec.strides is not None and spec.weighted and spec.weight_dtype == "float16")


def _kjts(**kwargs) -> st.SearchStrategy[KJTSpec]:
    kwargs.setdefault("value_dtypes", ALL_VALUE_DTYPES)
    kwargs.setdefault("weight_dtypes", FLOAT_DTYPES)
    return kjt_specs(**kwargs).filter(kjt_drawable)


@dataclass(frozen=True)
class Split:
    kjt: KJTSpec
    segments: tuple[int, ...]


@st.composite
def _splits(draw: st.DrawFn) -> Split:
    spec = draw(_kjts())
    cuts = sorted(draw(st.lists(st.integers(0, len(spec.keys)), max_size=4)))
    bounds = [0] + cuts + [len(spec.keys)]
    return Split(spec, tuple(bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)))


def _split(spec: Split) -> None:
    ref = spec.kjt.reference()
    pieces = build_kjt(ref, spec.kjt.form, spec.kjt.metadata).split(list(spec.segments))
    expected = kjt_split(ref, list(spec.segments))
    expect_value(len(pieces), len(expected), f"len(kjt.split({list(spec.segments)}))")
    for i, (piece, want) in enumerate(zip(pieces, expected)):
        expect_kjt(piece, want, f"kjt.split({list(spec.segments)})[{i}]", inverse=want is ref)


@dataclass(frozen=True)
class Permute:
    kjt: KJTSpec
    indices: tuple[int, ...]
    indices_tensor: bool  # the caller hands torchrec the indices as a device tensor too


@st.composite
def _permutes(draw: st.DrawFn, dtypes: tuple[str, ...] = PERMUTE_VALUE_DTYPES) -> Permute:
    spec = draw(_kjts(value_dtypes=dtypes).filter(vbe_permute_takes))
    keys = range(len(spec.keys))
    if draw(st.booleans()):
        indices = tuple(draw(st.permutations(list(keys))))
    else:  # keys taken twice and left out, as a sharded module's features order does
        indices = tuple(draw(st.lists(st.sampled_from(list(keys)), min_size=1, max_size=len(spec.keys) + 2)))
    return Permute(spec, indices, draw(st.booleans()))


def _permute(spec: Permute) -> None:
    ref = spec.kjt.reference()
    kjt = build_kjt(ref, spec.kjt.form, spec.kjt.metadata)
    tensor = torch.tensor(list(spec.indices), dtype=torch.int32) if spec.indices_tensor else None
    permuted = refused_dtype(lambda: kjt.permute(list(spec.indices), tensor),
                             f"kjt.permute of {ref.value_dtype} values, {ref.weight_dtype} weights{' (VBE)' if ref.variable else ''}")
    # Checked first, before an accessor computes them: permute reads the lengths per key to size
    # its output, and the result keeps them (reading them again is another host read on a GPU).
    expect_value(permuted.length_per_key_or_none(), [ref.length_per_key()[i] for i in spec.indices],
                 f"kjt.permute({list(spec.indices)}).length_per_key_or_none()")
    expect_kjt(permuted, kjt_permute(ref, list(spec.indices)), f"kjt.permute({list(spec.indices)})", inverse=False)


def _to_dict(spec: KJTSpec) -> None:
    from torchrec.sparse.jagged_tensor import ComputeKJTToJTDict

    ref = spec.reference()
    expected = kjt_to_dict(ref)
    for where, jts in (
        ("kjt.to_dict()", build_kjt(ref, spec.form, spec.metadata).to_dict()),
        ("kjt.to_dict(compute_offsets=False)", build_kjt(ref, spec.form, spec.metadata).to_dict(compute_offsets=False)),
        ("ComputeKJTToJTDict()(kjt)", ComputeKJTToJTDict()(build_kjt(ref, spec.form, spec.metadata))),
    ):
        expect_value(list(jts), list(expected), f"list({where})")
        for key, jt in jts.items():
            expect_jt(jt, expected[key], f"{where}[{key!r}]")


def _getitem(spec: KJTSpec) -> None:
    ref = spec.reference()
    kjt = build_kjt(ref, spec.form, spec.metadata)
    for key in ref.keys:
        expect_jt(kjt[key], ref.jt(key), f"kjt[{key!r}]")


def _flatten_lengths(spec: KJTSpec) -> None:
    ref = spec.reference()
    expect_kjt(build_kjt(ref, spec.form, spec.metadata).flatten_lengths(), replace(ref, inverse=None), "kjt.flatten_lengths()", inverse=False)


@st.composite
def _concats(draw: st.DrawFn) -> tuple[KJTSpec, ...]:
    """2-3 KJTs that may be joined: one batch size (or VBE over as many ranks), one set of dtypes,
    weighted all or none, inverse indices on all (one output batch) or none."""
    first = draw(_kjts())
    common = dict(
        variable=first.strides is not None, weighted=first.weighted, value_dtypes=(first.value_dtype,),
        weight_dtypes=(first.weight_dtype,), lengths_dtypes=(first.lengths_dtype,), batch=first.batch_size,
        ranks=len(first.strides[0]) if first.strides else None, inverse_batch=first.inverse_batch,
        inverse=first.inverse_batch is not None,
    )
    others = draw(st.lists(_kjts(**common).filter(lambda s: s.inverse_batch == first.inverse_batch), min_size=1, max_size=2))
    return (first, *others)


def _concat(specs: tuple[KJTSpec, ...]) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    refs = [spec.reference() for spec in specs]
    kjts = [build_kjt(ref, spec.form, spec.metadata) for ref, spec in zip(refs, specs)]
    expect_kjt(KeyedJaggedTensor.concat(kjts), kjt_concat(refs), f"KeyedJaggedTensor.concat([{len(kjts)} KJTs])")


@dataclass(frozen=True)
class MoveTo:
    kjt: KJTSpec
    non_blocking: bool
    dtype: str | None  # to(..., dtype=) casts the weights


def _move_to(spec: MoveTo) -> None:
    ref = spec.kjt.reference()
    kjt = build_kjt(ref, spec.kjt.form, spec.kjt.metadata)
    dtype = None if spec.dtype is None else torch_dtype(spec.dtype)
    moved = kjt.to(kjt.device(), non_blocking=spec.non_blocking, dtype=dtype)
    # The metadata travels with the KJT (computed or not), before anything asks for it.
    expect_value(moved.length_per_key_or_none(), ref.length_per_key() if spec.kjt.metadata else None, "kjt.to(...).length_per_key_or_none()")
    expected = ref if spec.dtype is None else kjt_cast_weights(ref, spec.dtype, lambda w: round_to(spec.dtype, w))
    expect_kjt(moved, expected, f"kjt.to(device, non_blocking={spec.non_blocking}, dtype={spec.dtype})")


@dataclass(frozen=True)
class CopyInto:
    """``kjt`` copied into a fresh target of the same shapes built from ``target_form``."""

    kjt: KJTSpec
    target_form: str


def _copy(spec: KJTSpec | CopyInto) -> None:
    """``target.copy_(kjt)`` into a fresh KJT of the same shapes holding other numbers (built the same way,
    or from another form: what the source carries and the target lacks is computed from what it has)."""
    kjt, target_form = (spec.kjt, spec.target_form) if isinstance(spec, CopyInto) else (spec, spec.form)
    ref = kjt.reference()
    target = build_kjt(replace(kjt, seed=kjt.seed + 1).reference(), target_form, kjt.metadata)
    target.copy_(build_kjt(ref, kjt.form, kjt.metadata))
    expect_kjt(target, ref, f"target.copy_(kjt) (kjt from {kjt.form}, the target from {target_form})")


def _clear_storage(spec: Permute) -> None:
    """clear_storage frees the KJT's tensors and says how many bytes; what permute made before stays
    (the training pipeline frees a batch's KJT once its modules have permuted their features out)."""
    ref = spec.kjt.reference()
    kjt = build_kjt(ref, spec.kjt.form, spec.kjt.metadata)
    permuted = kjt.permute(list(spec.indices))
    held = [t for t in (kjt.values(), kjt.lengths_or_none(), kjt.offsets_or_none(), kjt.weights_or_none()) if t is not None]
    expect_value(kjt.clear_storage(), sum(t.numel() * t.element_size() for t in held), "kjt.clear_storage()")
    expect_value([t.untyped_storage().size() for t in held], [0] * len(held), "storage bytes after kjt.clear_storage()")
    expect_kjt(permuted, kjt_permute(ref, list(spec.indices)), "kjt.permute(...) made before kjt.clear_storage()", inverse=False)


def _pytree(spec: KJTSpec) -> None:
    from torch.utils import _pytree as pytree

    ref = spec.reference()
    leaves, tree = pytree.tree_flatten(build_kjt(ref, spec.form, spec.metadata))
    expect_kjt(pytree.tree_unflatten(leaves, tree), ref, "tree_unflatten(tree_flatten(kjt))")


def kjt_op_cases() -> list[OpCase]:
    kjts = _kjts()
    float64_permute = Permute(replace(PINNED_FIXED, value_dtype="float64"), (2, 0, 1), False)
    vbe_half_weights = Permute(replace(PINNED_VBE, weight_dtype="float16"), (2, 0, 1), False)
    pinned_permutes = (Permute(PINNED_FIXED, (2, 0, 1), False), Permute(PINNED_VBE, (1, 2, 0, 1), True),
                       Permute(PINNED_FIXED, (1, 1, 2), True), float64_permute, vbe_half_weights)
    moves = st.builds(MoveTo, kjts, st.booleans(), st.sampled_from((None,) + FLOAT_DTYPES))
    return [
        OpCase("kjt.split", _splits(), _split, (Split(PINNED_FIXED, (1, 0, 2)), Split(PINNED_VBE, (2, 1)), Split(PINNED_VBE, (0, 3)))),
        OpCase("kjt.permute", _permutes(), _permute, pinned_permutes),
        OpCase("kjt.to_dict", _kjts().filter(lambda s: kjt_drawable(s, to_dict=True)), _to_dict,
               tuple(s for s in PINNED_KJTS if kjt_drawable(s, to_dict=True))),
        OpCase("kjt.getitem", kjts, _getitem, PINNED_KJTS),
        OpCase("kjt.flatten_lengths", kjts, _flatten_lengths, PINNED_KJTS),
        OpCase("kjt.concat", _concats(), _concat, ((PINNED_FIXED, replace(PINNED_FIXED, keys=("f5", "f6", "f7"), seed=3)),)),
        # A KJT of no keys: its batch size lives in the stride alone, which the copy must carry.
        OpCase("kjt.to", moves, _move_to, (MoveTo(PINNED_VBE, True, "float16"), MoveTo(NO_KEYS, False, None))),
        OpCase("kjt.copy_", kjts, _copy, PINNED_KJTS + (CopyInto(replace(PINNED_FIXED, form="lengths+offsets"), "lengths"),
                                                        CopyInto(replace(PINNED_FIXED, form="lengths+offsets"), "offsets"))),
        OpCase("kjt.pytree", kjts, _pytree, PINNED_KJTS),
        OpCase("kjt.clear_storage", _permutes(), _clear_storage, pinned_permutes[:2]),
    ]



