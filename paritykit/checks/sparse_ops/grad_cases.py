"""Autograd of the sparse ops that training differentiates, against the reference's vjp (gradients.py).

- ``grad.kt.regroup``: pooled embeddings from several KeyedTensors through ``regroup``,
  ``regroup_as_dict``, ``KTRegroupAsDict``, ``permute_multi_embedding`` and ``regroup_kts`` (a key
  used in two groups gets the sum of both gradients).
- ``grad.kt.from_tensor_list+getitem+to_dict``.
- ``grad.jt.to_padded_dense+weights``: values (1-D and 2-D) and weights; truncated entries get 0.
- ``grad.jt.from_dense+from_dense_lengths+to_dense``.
- ``grad.kjt.permute+split+getitem+to_dict+concat``: the per-id weights (and float values) of a
  weighted KJT, as a feature processor's output flows through the input distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import build_jt, build_kjt, build_kt, flat_tensor, tensor
from paritykit.checks.sparse_ops.cases import OpCase
from paritykit.checks.sparse_ops.gradients import expect_grads, tag_jt, tag_kjt, tag_kt
from paritykit.checks.sparse_ops.jt_cases import PINNED_JT, PINNED_JT_2D
from paritykit.checks.sparse_ops.kjt_cases import PINNED_FIXED, PINNED_VBE
from paritykit.checks.sparse_ops.kt_cases import PINNED_GROUPS, PINNED_KTS, Regroup, regroup_drawable, regroups
from paritykit.checks.sparse_ops.reference import (
    Array,
    RefJT,
    jt_from_dense,
    jt_to_dense,
    kjt_concat,
    kjt_permute,
    kjt_split,
    kjt_to_dict,
    pad_rows,
    padded_width,
)
from paritykit.checks.sparse_ops.reference_keyed import kt_from_blocks, kt_getitem, kt_regroup
from paritykit.checks.sparse_ops.rules import (
    MULTI_EMBEDDING_UNUSED_KEY_GRAD,
    jt_padding_drawable,
    kept_out,
    kjt_drawable,
    permute_grad_drawable,
)
from paritykit.checks.sparse_ops.specs import JTSpec, KJTSpec, jt_specs, kjt_specs

GRAD_DTYPES = ("float16", "float32")


def _regroup_grads(spec: Regroup) -> None:
    import torchrec.sparse.jagged_tensor as jagged_tensor
    from torchrec.modules.regroup import KTRegroupAsDict
    from torchrec.sparse.jagged_tensor import KeyedTensor

    refs = [kt.reference() for kt in spec.kts]
    tagged = kt_regroup([tag_kt(r, f"kts[{i}].values") for i, r in enumerate(refs)], [list(g) for g in spec.groups])
    groups, names = [list(g) for g in spec.groups], [f"group{g}" for g in range(len(spec.groups))]
    calls = {
        "KeyedTensor.regroup": lambda kts: KeyedTensor.regroup(kts, groups),
        "KeyedTensor.regroup_as_dict": lambda kts: list(KeyedTensor.regroup_as_dict(kts, groups, names).values()),
        "KTRegroupAsDict": lambda kts: list(KTRegroupAsDict(groups, names)(kts).values()),
        "permute_multi_embedding": lambda kts: jagged_tensor.permute_multi_embedding(kts, groups),
        "regroup_kts": lambda kts: jagged_tensor.regroup_kts(kts, groups),
    }
    missing = [name for name in ("regroup_as_dict", "permute_multi_embedding", "regroup_kts")
               if not hasattr(KeyedTensor if name == "regroup_as_dict" else jagged_tensor, name)]
    unused = {key for kt in spec.kts for key in kt.keys} - {key for group in groups for key in group}
    if unused and kept_out(MULTI_EMBEDDING_UNUSED_KEY_GRAD):  # known-broken case: garbage gradients
        missing += ["KTRegroupAsDict", "permute_multi_embedding", "regroup_kts"]
    for name in missing:
        calls.pop(name if name in calls else f"KeyedTensor.{name}", None)
    for where, call in calls.items():
        kts = [build_kt(r, grad=True) for r in refs]
        outputs = call(kts)
        inputs = {f"kts[{i}].values": kt.values() for i, kt in enumerate(kts)}
        expect_grads(list(zip(outputs, tagged)), inputs, f"{where}(kts, {groups})", spec.kts[0].seed)


def _kt_grads(spec: Regroup) -> None:
    from torchrec.sparse.jagged_tensor import KeyedTensor

    for i, kt_spec in enumerate(spec.kts):
        ref = kt_spec.reference()
        tagged = tag_kt(ref, "kt.values")
        kt = build_kt(ref, grad=True)
        outputs = [(kt[key], kt_getitem(tagged, key)) for key in ref.keys]
        outputs += [(t, kt_getitem(tagged, key)) for key, t in kt.to_dict().items()]
        expect_grads(outputs, {"kt.values": kt.values()}, f"kts[{i}][key] and kts[{i}].to_dict()", kt_spec.seed)
        blocks = {key: tensor(kt_getitem(ref, key), requires_grad=True) for key in ref.keys}
        joined = KeyedTensor.from_tensor_list(list(ref.keys), list(blocks.values()), key_dim=ref.key_dim, cat_dim=ref.key_dim)
        tagged_blocks = [[tuple((f"blocks[{key!r}]", r * len(row) + c) for c in range(len(row))) for r, row in enumerate(ref.block(key))]
                         for key in ref.keys]
        want = kt_from_blocks(ref.keys, tagged_blocks, ref.dims, ref.batch, ref.key_dim, ref.dtype)
        expect_grads([(joined.values(), want.values_array())], {f"blocks[{k!r}]": t for k, t in blocks.items()},
                     f"KeyedTensor.from_tensor_list(kts[{i}] blocks)", kt_spec.seed + 1)


@dataclass(frozen=True)
class PaddedGrad:
    jt: JTSpec
    desired_length: int | None


def _padded_grads(spec: PaddedGrad) -> None:
    ref = spec.jt.reference()
    tagged = tag_jt(ref, "values")
    width = padded_width(ref.lengths, spec.desired_length)
    jt = build_jt(ref, spec.jt.form, grad=True)
    outputs = [(jt.to_padded_dense(spec.desired_length, 0.0), pad_rows(tagged.rows(), width, None, ref.dim, None))]
    inputs = {"values": jt.values()}
    if ref.weights is not None:
        outputs.append((jt.to_padded_dense_weights(spec.desired_length, 0.0), pad_rows(tagged.weight_rows(), width, None, 0, None)))
        inputs["values.weights"] = jt.weights()
    expect_grads(outputs, inputs, f"jt.to_padded_dense(desired_length={spec.desired_length}) (and _weights)", spec.jt.seed)


def _dense_grads(spec: JTSpec) -> None:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    ref = spec.reference()
    rows = [flat_tensor(row, ref.value_dtype, ref.dim).requires_grad_() for row in ref.rows()]
    jt = JaggedTensor.from_dense(values=rows)
    tagged_rows = [tag_jt(RefJT((len(r),), tuple(r), None, ref.value_dtype, None, dim=ref.dim), f"rows[{b}]").values for b, r in enumerate(ref.rows())]
    joined = jt_from_dense(list(tagged_rows), None, ref.value_dtype, None, ref.dim)
    expect_grads([(jt.values(), joined.values_array())], {f"rows[{b}]": t for b, t in enumerate(rows)}, "JaggedTensor.from_dense(rows)", spec.seed)
    source = build_jt(ref, spec.form, grad=True)
    tagged = tag_jt(ref, "values")
    expect_grads(list(zip(source.to_dense(), jt_to_dense(tagged))), {"values": source.values()}, "jt.to_dense()", spec.seed + 1)
    width = max(ref.lengths)
    dense = tensor(pad_rows(ref.rows(), width, 0, ref.dim, ref.value_dtype), requires_grad=True)
    made = JaggedTensor.from_dense_lengths(dense, flat_tensor(ref.lengths, ref.lengths_dtype or "int64"))
    # Each dense element tagged by its own position; the op keeps the first lengths[b] of row b.
    per_row = width * max(ref.dim, 1)
    picked = tuple(("dense", b * per_row + i) for b, n in enumerate(ref.lengths) for i in range(n * max(ref.dim, 1)))
    expect_grads([(made.values(), Array(tuple(made.values().shape), picked, None))], {"dense": dense},
                 "JaggedTensor.from_dense_lengths(dense, lengths)", spec.seed + 2)


@dataclass(frozen=True)
class KJTGrad:
    kjt: KJTSpec
    indices: tuple[int, ...]
    segments: tuple[int, ...]


@st.composite
def _kjt_grads_specs(draw: st.DrawFn) -> KJTGrad:
    spec = draw(kjt_specs(weighted=True, weight_dtypes=GRAD_DTYPES).filter(lambda s: kjt_drawable(s, to_dict=True)))
    keys = list(range(len(spec.keys)))
    indices = tuple(draw(st.one_of(st.permutations(keys), st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys) + 1))))
    cut = draw(st.integers(0, len(keys)))
    return KJTGrad(spec, indices, (cut, len(keys) - cut))


def _kjt_grads(spec: KJTGrad) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ref = spec.kjt.reference()
    tagged = tag_kjt(ref, "values")
    inputs_of = lambda kjt: {"values.weights": kjt.weights()}  # noqa: E731 - ids carry no gradient
    if permute_grad_drawable(spec.indices, len(ref.keys), ref.variable):
        kjt = build_kjt(ref, spec.kjt.form, spec.kjt.metadata, grad=True)
        _expect_kjt_grads(kjt.permute(list(spec.indices)), kjt_permute(tagged, list(spec.indices)), inputs_of(kjt), f"kjt.permute({list(spec.indices)})", spec.kjt.seed)
    kjt = build_kjt(ref, spec.kjt.form, spec.kjt.metadata, grad=True)
    pieces, tagged_pieces = kjt.split(list(spec.segments)), kjt_split(tagged, list(spec.segments))
    outputs = [pair for piece, want in zip(pieces, tagged_pieces) for pair in _kjt_outputs(piece, want)]
    expect_grads(outputs, inputs_of(kjt), f"kjt.split({list(spec.segments)})", spec.kjt.seed + 1)
    kjt = build_kjt(ref, spec.kjt.form, spec.kjt.metadata, grad=True)
    by_key = kjt_to_dict(tagged)
    outputs = [(jt.weights(), _weights_array(by_key[key])) for key, jt in kjt.to_dict().items()]
    outputs += [(kjt[key].weights(), _weights_array(by_key[key])) for key in ref.keys]
    expect_grads(outputs, inputs_of(kjt), "kjt.to_dict() and kjt[key]", spec.kjt.seed + 2)
    kjts = [build_kjt(ref, spec.kjt.form, spec.kjt.metadata, grad=True) for _ in range(2)]
    joined = kjt_concat([tag_kjt(ref, "first"), tag_kjt(ref, "second")])
    inputs = {"first.weights": kjts[0].weights(), "second.weights": kjts[1].weights()}
    _expect_kjt_grads(KeyedJaggedTensor.concat(kjts), joined, inputs, "KeyedJaggedTensor.concat([kjt, kjt])", spec.kjt.seed + 3)


def _weights_array(jt: RefJT) -> Array:
    return Array((len(jt.weights),), jt.weights, None)


def _kjt_outputs(kjt, tagged) -> list:
    return [(kjt.weights(), Array((len(tagged.flat_weights()),), tagged.flat_weights(), None))]


def _expect_kjt_grads(kjt, tagged, inputs, where: str, seed: int) -> None:
    expect_grads(_kjt_outputs(kjt, tagged), inputs, where, seed)


def grad_cases() -> list[OpCase]:
    drawn_regroups = regroups(dtypes=GRAD_DTYPES, key_dims=(1,)).filter(regroup_drawable)
    pinned_regroups = tuple(Regroup(PINNED_KTS, g) for g in PINNED_GROUPS)
    paddeds = st.builds(PaddedGrad, jt_specs(value_dtypes=GRAD_DTYPES, weight_dtypes=GRAD_DTYPES, dims=(0, 2)),
                        st.one_of(st.none(), st.integers(0, 5))).filter(lambda p: jt_padding_drawable(p.jt, p.desired_length))
    dense = jt_specs(min_rows=1, value_dtypes=GRAD_DTYPES, dims=(0, 2)).filter(lambda s: max(s.lengths) > 0)
    return [
        OpCase("grad.kt.regroup", drawn_regroups, _regroup_grads, pinned_regroups),
        OpCase("grad.kt.from_tensor_list+getitem+to_dict", regroups(dtypes=GRAD_DTYPES), _kt_grads, pinned_regroups[:1]),
        OpCase("grad.jt.to_padded_dense+weights", paddeds, _padded_grads, (PaddedGrad(PINNED_JT, 2), PaddedGrad(PINNED_JT_2D, None))),
        OpCase("grad.jt.from_dense+from_dense_lengths+to_dense", dense, _dense_grads, (PINNED_JT, PINNED_JT_2D)),
        OpCase("grad.kjt.permute+split+getitem+to_dict+concat", _kjt_grads_specs(), _kjt_grads,
               (KJTGrad(PINNED_FIXED, (2, 0, 1), (1, 2)), KJTGrad(PINNED_VBE, (1, 2, 0), (0, 3)))),
    ]
