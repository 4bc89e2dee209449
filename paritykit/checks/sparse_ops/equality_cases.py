"""``kjt_is_equal`` and ``jt_is_equal`` (torchrec.sparse.jagged_tensor), as their docstrings define
equality: the same keys in the same order, the same lengths of every sample, the same values and
weights (present in both or in neither), the same batch. A KJT is compared with one built from the
same reference in another form (lengths, offsets or both: equal), and with one whose reference
changes one thing (a value, a weight, the weights dropped, a key renamed, two keys' names swapped, one
id moved to the next sample: not equal); each way round. ``jt_is_equal`` likewise on the first key's
JaggedTensor, whose data the changes touch first. Float values and weights are changed by 1, far
outside ``torch.allclose``'s tolerance, which the functions use; integer ids compared within it are
a known issue (kjt-is-equal-ids-within-tolerance: a large id and the next one compare equal).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import build_jt, build_kjt
from paritykit.checks.sparse_ops.cases import OpCase
from paritykit.checks.sparse_ops.expect import expect_value
from paritykit.checks.sparse_ops.kjt_cases import PINNED_FIXED, PINNED_VBE
from paritykit.checks.sparse_ops.reference import RefKJT
from paritykit.checks.sparse_ops.rules import ids_comparable, kjt_drawable
from paritykit.checks.sparse_ops.specs import FORMS, KJTSpec, kjt_specs
from paritykit.checks.sparse_ops.values import INT_DTYPES

CHANGES = ("none", "value", "weight", "drop-weights", "rename-key", "swap-keys", "move-id")


@dataclass(frozen=True)
class Equality:
    kjt: KJTSpec
    change: str  # one of CHANGES; "none": the same data built in ``other_form``
    other_form: str


def _first_with_values(ref: RefKJT) -> int | None:
    return next((k for k, values in enumerate(ref.values) if values), None)


def _changed(ref: RefKJT, change: str) -> RefKJT | None:
    """The reference with one thing changed; None where the change does not apply to it."""
    k = _first_with_values(ref)
    at = lambda rows, new: tuple(new if i == k else row for i, row in enumerate(rows))  # noqa: E731
    if change == "value" and k is not None:
        return replace(ref, values=at(ref.values, (ref.values[k][0] + 1,) + tuple(ref.values[k][1:])))
    if change == "weight" and k is not None and ref.weights is not None:
        return replace(ref, weights=at(ref.weights, (ref.weights[k][0] + 1.0,) + tuple(ref.weights[k][1:])))
    if change == "drop-weights" and ref.weights is not None:
        return replace(ref, weights=None)
    if change == "rename-key":
        return replace(ref, keys=ref.keys[:-1] + ("renamed",))
    if change == "swap-keys" and len(ref.keys) > 1:
        return replace(ref, keys=(ref.keys[1], ref.keys[0]) + ref.keys[2:])
    if change == "move-id" and k is not None:
        lengths = list(ref.lengths[k])
        source = next(i for i, n in enumerate(lengths) if n)
        if len(lengths) > 1:  # one id of that sample goes to the next sample (or the previous, from the last)
            lengths[source] -= 1
            lengths[source + 1 if source + 1 < len(lengths) else source - 1] += 1
            return replace(ref, lengths=at(ref.lengths, tuple(lengths)))
    return None


def equality_drawable(case: Equality) -> bool:
    """Not a change of a large id, which kjt_is_equal does not see (known issue), where it stands."""
    if case.change != "value" or case.kjt.value_dtype not in INT_DTYPES:
        return True
    ref = case.kjt.reference()
    k = _first_with_values(ref)
    return k is None or ids_comparable([ref.values[k][0], ref.values[k][0] + 1])


@st.composite
def _equalities(draw: st.DrawFn) -> Equality:
    spec = draw(kjt_specs(inverse=False).filter(kjt_drawable))
    return Equality(spec, draw(st.sampled_from(CHANGES)), draw(st.sampled_from(FORMS)))


def _equality(case: Equality) -> None:
    from torchrec.sparse.jagged_tensor import jt_is_equal, kjt_is_equal

    ref = case.kjt.reference()
    other = ref if case.change == "none" else _changed(ref, case.change)
    if other is None:
        other = ref  # the change does not apply: the same data, in the other form
    same = other is ref
    what = "the same data in another form" if same else f"one change ({case.change})"
    a, b = build_kjt(ref, case.kjt.form), build_kjt(other, case.other_form)
    expect_value(kjt_is_equal(a, b), same, f"kjt_is_equal(kjt, kjt with {what})")
    expect_value(kjt_is_equal(b, a), same, f"kjt_is_equal(kjt with {what}, kjt)")
    if ref.keys:  # the first key's data (a renamed or swapped key name leaves it as it was)
        first, changed_first = ref.jt(ref.keys[0]), other.jt(other.keys[0])
        jt_a, jt_b = build_jt(first, "lengths"), build_jt(changed_first, "offsets")
        expect_value(jt_is_equal(jt_a, jt_b), first == changed_first,
                     f"jt_is_equal(the first key's JaggedTensor, the same with {what})")


def equality_cases() -> list[OpCase]:
    pinned = tuple(Equality(spec, change, "offsets") for spec in (PINNED_FIXED, PINNED_VBE) for change in CHANGES)
    return [OpCase("kjt_is_equal+jt_is_equal", _equalities().filter(equality_drawable), _equality,
                   tuple(filter(equality_drawable, pinned)))]


def is_equal_ids_within_tolerance() -> None:
    """The known-broken case: batches differing in one id, 1000000 against 1000001."""
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, jt_is_equal, kjt_is_equal

    kjts = [KeyedJaggedTensor(keys=["f0"], values=torch.tensor([i, 7]), lengths=torch.tensor([1, 1])) for i in (1000000, 1000001)]
    jts = [JaggedTensor(values=torch.tensor([i]), lengths=torch.tensor([1])) for i in (1000000, 1000001)]
    expect_value(kjt_is_equal(*kjts), False, "kjt_is_equal of KJTs with ids 1000000 and 1000001")
    expect_value(jt_is_equal(*jts), False, "jt_is_equal of JaggedTensors with ids 1000000 and 1000001")
