"""Sparse-op inputs that torchrec gets wrong (rules.py), each run on purpose by every gate as a minimal
reproduction against the reference, so that its failure is matched against the known issues
(paritykit/checks/known_issues.toml, case ``known-broken <rule>: <what>``) and ``--strict`` notices
the day torchrec fixes it.

The non-bijective permute backward can kill the process (fbgemm reads outside the permutation), so
that one runs on a rank of the pool, where a crash is a RankFailure; the others run in the caller.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from paritykit.checks.sparse_ops.build import build_jt, build_kjt, build_kt
from paritykit.checks.sparse_ops.expect import expect_array, expect_jt, expect_kjt, expect_value
from paritykit.checks.sparse_ops.gradients import expect_grads, tag_kjt, tag_kt
from paritykit.checks.sparse_ops.reference import Array, kjt_permute, kjt_to_dict
from paritykit.checks.sparse_ops.reference_keyed import kt_regroup
from paritykit.checks.sparse_ops.rules import (
    CONSTRUCT_ZERO_BATCH,
    COPY_KEEPS_STALE_LAYOUT,
    IS_EQUAL_IDS_TOLERANCE,
    MULTI_EMBEDDING_UNUSED_KEY_GRAD,
    OFFSETS_ZERO_BATCH,
    PADDED_DENSE_NO_ROWS,
    PERMUTE_GRAD_NOT_BIJECTIVE,
    REGROUP_KEY_DIM_0,
    TO_DICT_ZERO_BATCH,
    VBE_PERMUTE_NO_GRAD,
)
from paritykit.checks.sparse_ops.specs import JTSpec, KJTSpec, KTSpec
from paritykit.checks.sparse_ops.embedding_cases import construct_zero_batch
from paritykit.checks.sparse_ops.equality_cases import is_equal_ids_within_tolerance
from paritykit.checks.sparse_ops.validator_cases import KNOWN_BROKEN_VALIDATOR

ZERO_BATCH = KJTSpec(("f0", "f1"), ((), ()), None, 0, True, "int64", "float32", "int32", "lengths", False, 41)
WEIGHTED = KJTSpec(("f0", "f1"), ((2, 0, 1), (1, 3, 0)), None, 3, True, "int64", "float32", "int64", "lengths", False, 42)
VBE = KJTSpec(("f0", "f1"), ((2, 0), (1, 3, 1)), ((2,), (3,)), 0, True, "int64", "float32", "int64", "lengths", False, 43)
# Two batches of the same shapes (keys, samples, values) whose rows split the values otherwise.
COPIED_INTO = KJTSpec(("f0", "f1"), ((1, 1), (1, 1)), None, 2, True, "int64", "float32", "int64", "lengths", False, 52)
COPIED = KJTSpec(("f0", "f1"), ((2, 0), (0, 2)), None, 2, True, "int64", "float32", "int64", "lengths", False, 53)


def _to_dict_zero_batch() -> None:
    ref = ZERO_BATCH.reference()
    jts = build_kjt(ref).to_dict()
    for key, want in kjt_to_dict(ref).items():
        expect_jt(jts[key], want, f"kjt.to_dict()[{key!r}] of a batch of no samples")


def _offsets_zero_batch() -> None:
    """length_per_key before anything asked for the lengths (as from_offsets_sync, permute, split do)."""
    ref = ZERO_BATCH.reference()
    kjt = build_kjt(ref, "offsets")
    expect_value(kjt.length_per_key(), ref.length_per_key(), "KeyedJaggedTensor(offsets=[0], stride=0).length_per_key()")
    expect_kjt(kjt, ref, "KeyedJaggedTensor(offsets=[0], stride=0)")


def _padded_dense_no_rows() -> None:
    jt = build_jt(JTSpec((), True, "float32", "float32", "int64", "lengths", 44).reference())
    expect_array(jt.to_padded_dense(), Array((0, 0), (), "float32"), "jt.to_padded_dense() of no rows")


def _regroup_key_dim_0() -> None:
    from torchrec.sparse.jagged_tensor import KeyedTensor

    # Blocks of 2 columns: dim-1 joining fits, so torchrec returns numbers, not an error.
    specs = (KTSpec(("f0", "f1"), (1, 1), 2, "float32", 45, key_dim=0), KTSpec(("f2",), (2,), 2, "float32", 46, key_dim=0))
    refs = [spec.reference() for spec in specs]
    groups = [["f2", "f0"], ["f1"]]
    actual = KeyedTensor.regroup([build_kt(ref) for ref in refs], groups)
    for g, (tensor, want) in enumerate(zip(actual, kt_regroup(refs, groups), strict=True)):
        expect_array(tensor, want, f"KeyedTensor.regroup(key_dim-0 kts, {groups})[{g}]")


def _copy_into_a_used_kjt() -> None:
    """target.copy_(kjt) where the target was used (its offsets, or lengths, computed, as a lookup or
    to_dict computes them) and kjt, of the same shapes, was built from lengths (offsets) alone."""
    for form, computed in (("lengths", "offsets"), ("offsets", "lengths")):
        target = build_kjt(COPIED_INTO.reference(), form)
        getattr(target, computed)()
        ref = COPIED.reference()
        target.copy_(build_kjt(ref, form))
        expect_kjt(target, ref, f"target.copy_(kjt) of a KJT built from {form}, into one whose {computed} were computed")


def permute_grad_not_bijective() -> None:
    """On a rank: the weights' gradient through permute([1, 0, 1]) (f1 taken twice)."""
    ref = WEIGHTED.reference()
    kjt = build_kjt(ref, grad=True)
    permuted = kjt.permute([1, 0, 1])
    want = kjt_permute(tag_kjt(ref, "values"), [1, 0, 1])
    expect_grads([(permuted.weights(), Array((len(want.flat_weights()),), want.flat_weights(), None))],
                 {"values.weights": kjt.weights()}, "kjt.permute([1, 0, 1])", 47)


def _vbe_permute_no_grad() -> None:
    ref = VBE.reference()
    kjt = build_kjt(ref, grad=True)
    want = kjt_permute(tag_kjt(ref, "values"), [1, 0])
    with warnings.catch_warnings():  # torch warns that permute_1D_sparse_data has no autograd kernel: the defect itself
        warnings.simplefilter("ignore", UserWarning)
        expect_grads([(kjt.permute([1, 0]).weights(), Array((len(want.flat_weights()),), want.flat_weights(), None))],
                     {"values.weights": kjt.weights()}, "VBE kjt.permute([1, 0])", 48)


def _multi_embedding_unused_key_grad() -> None:
    """Uninitialised memory is not always non-zero: a few attempts, the first difference fails."""
    for _ in range(UNUSED_KEY_ATTEMPTS):
        _unused_key_grad_once()


UNUSED_KEY_ATTEMPTS = 5


def _unused_key_grad_once() -> None:
    from torchrec.modules.regroup import KTRegroupAsDict

    # f1 is in no group. Freed memory of the gradient's size, filled with 7s, makes the garbage show.
    specs = (KTSpec(("f0", "f1"), (8, 8), 64, "float32", 49), KTSpec(("f2",), (8,), 64, "float32", 50))
    refs = [spec.reference() for spec in specs]
    kts = [build_kt(ref, grad=True) for ref in refs]
    out = KTRegroupAsDict([["f2", "f0"]], ["group0"])(kts)["group0"]
    tags = kt_regroup([tag_kt(ref, f"kts[{i}].values") for i, ref in enumerate(refs)], [["f2", "f0"]])
    for _ in range(2):  # freed blocks of the gradient's size, holding 7s
        torch.full((64, 16), 7.0).sum()
    expect_grads([(out, tags[0])], {f"kts[{i}].values": kt.values() for i, kt in enumerate(kts)},
                 "KTRegroupAsDict([['f2', 'f0']]) with f1 in no group", 51)


# rule -> (what the case does, body in the caller, or None where it runs on a rank)
KNOWN_BROKEN: dict[str, tuple[str, Callable[[], None] | None]] = {
    TO_DICT_ZERO_BATCH: ("to_dict of a KJT with keys and no samples", _to_dict_zero_batch),
    OFFSETS_ZERO_BATCH: ("a KJT of offsets [0] and no samples, its metadata and ops", _offsets_zero_batch),
    PADDED_DENSE_NO_ROWS: ("to_padded_dense() of a JaggedTensor with no rows", _padded_dense_no_rows),
    REGROUP_KEY_DIM_0: ("KeyedTensor.regroup of key_dim-0 KeyedTensors, every key once", _regroup_key_dim_0),
    PERMUTE_GRAD_NOT_BIJECTIVE: ("weights' gradient through permute([1, 0, 1]), on a rank", None),
    VBE_PERMUTE_NO_GRAD: ("weights' gradient through a VBE KJT's permute", _vbe_permute_no_grad),
    MULTI_EMBEDDING_UNUSED_KEY_GRAD: ("gradient of a key in no group through KTRegroupAsDict", _multi_embedding_unused_key_grad),
    **KNOWN_BROKEN_VALIDATOR,
    CONSTRUCT_ZERO_BATCH: ("construct_jagged_tensors of column shards with a batch of no samples", construct_zero_batch),
    IS_EQUAL_IDS_TOLERANCE: ("kjt_is_equal and jt_is_equal of batches differing in one id, 1000000 and 1000001",
                             is_equal_ids_within_tolerance),
    COPY_KEEPS_STALE_LAYOUT: ("copy_ into a used KJT (offsets or lengths computed) from one built from lengths or offsets",
                              _copy_into_a_used_kjt),
}


def run_on_rank(pool: Any) -> None:
    """The rank-side case: a crash of the rank is a RankFailure (a failure of the code under test)."""
    pool.run(permute_grad_not_bijective)
