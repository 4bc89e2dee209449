"""The sparse-ops references against hand-computed answers (no torchrec involved), and the
comparison helpers failing where they should."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.sparse_ops.expect import expect_array, expect_jt, expect_offsets
from paritykit.checks.sparse_ops.gradients import reference_grad, tag_jt
from paritykit.checks.sparse_ops.reference import (
    Array,
    RefJT,
    RefKJT,
    jt_from_dense_lengths,
    jt_to_padded_dense,
    kjt_concat,
    kjt_dist_splits,
    kjt_join_ranks,
    kjt_permute,
    kjt_split,
)
from paritykit.checks.sparse_ops.reference_keyed import RefKT, kt_getitem, kt_regroup
from paritykit.checks.sparse_ops.values import MAX_SUMMED_TERMS, UPSTREAM_MAX_STEPS, UPSTREAM_STEP, round_to
from paritykit.errors import HarnessError, ParityError

# keys a, b, c; batch of 2; c's second row and b's first are empty.
KJT = RefKJT(("a", "b", "c"), ((1, 2), (0, 1), (2, 0)), ((10, 11, 12), (20,), (30, 31)), ((0.5, 1.5, 2.5), (3.5,), (4.5, 5.5)),
             "int64", "int32", "float32", batch_size=2)
# The same keys with a variable batch: a has 1+1 samples on two ranks, b 2+0, c 0+1.
VBE = RefKJT(("a", "b", "c"), ((1, 2), (0, 1), (2,)), ((10, 11, 12), (20,), (30, 31)), None, "int64", "int64",
             strides=((1, 1), (2, 0), (0, 1)))


def test_permute_takes_keys_in_the_given_order_twice_or_not_at_all():
    out = kjt_permute(KJT, [2, 0, 2])
    assert out.keys == ("c", "a", "c")
    assert out.lengths == ((2, 0), (1, 2), (2, 0))
    assert out.flat_values() == (30, 31, 10, 11, 12, 30, 31)
    assert out.flat_weights() == (4.5, 5.5, 0.5, 1.5, 2.5, 4.5, 5.5)
    assert out.stride() == 2


def test_permute_of_a_variable_batch_keeps_each_keys_samples_and_the_batch_size():
    out = kjt_permute(VBE, [1, 2])
    assert out.stride_per_key_per_rank() == [[2, 0], [0, 1]]
    assert out.stride_per_key() == [2, 1]
    assert out.stride() == VBE.stride() == 2  # the largest number of samples of one key (a: 2, b: 2)


def test_split_pieces_cover_the_keys_in_order_and_keep_the_batch():
    pieces = kjt_split(KJT, [1, 0, 2])
    assert [p.keys for p in pieces] == [("a",), (), ("b", "c")]
    assert pieces[2].flat_lengths() == (0, 1, 2, 0)
    assert pieces[2].offset_per_key() == [0, 1, 3]
    assert [p.stride() for p in pieces] == [2, 2, 2]
    with pytest.raises(ValueError):
        kjt_split(KJT, [1, 1])


def test_stride_of_a_variable_batch_with_inverse_indices_is_the_output_batch():
    with_inverse = RefKJT(VBE.keys, VBE.lengths, VBE.values, None, "int64", "int64", strides=VBE.strides,
                          inverse=((0, 1, 1, 0, 1), (0, 0, 1, 1, 0), (0, 0, 0, 0, 0)))
    assert with_inverse.stride() == 5
    assert VBE.lengths_offset_per_key() == [0, 2, 4, 5]


def test_concat_joins_keys_and_their_rows():
    out = kjt_concat([KJT, kjt_permute(KJT, [1])])
    assert out.keys == ("a", "b", "c", "b")
    assert out.flat_lengths() == (1, 2, 0, 1, 2, 0, 0, 1)
    assert out.length_per_key() == [3, 1, 2, 1]


def test_dist_splits_count_batch_sizes_lengths_and_weights_per_destination():
    assert kjt_dist_splits(KJT, [2, 1]) == [[4, 2], [4, 2], [4, 2]]
    assert kjt_dist_splits(VBE, [1, 2]) == [[2, 3], [3, 3], [1, 2]]


def test_joining_ranks_puts_each_keys_samples_of_rank_0_before_rank_1():
    rank0 = RefKJT(("a", "b"), ((1,), (2,)), ((1,), (2, 3)), None, "int64", "int64", batch_size=1)
    rank1 = RefKJT(("a", "b"), ((0, 2), (1, 1)), ((6, 7), (4, 5)), None, "int64", "int64", batch_size=2)
    joined = kjt_join_ranks([rank0, rank1])
    assert joined.lengths == ((1, 0, 2), (2, 1, 1))
    assert joined.values == ((1, 6, 7), (2, 3, 4, 5))
    assert joined.stride() == 3


def test_padded_dense_cuts_rows_to_the_requested_length_and_pads_the_rest():
    jt = RefJT((2, 0, 3), (1, 2, 3, 4, 5), None, "float32", "int64")
    assert jt_to_padded_dense(jt, 2, 9.0) == Array((3, 2), (1, 2, 9.0, 9.0, 3, 4), "float32")
    assert jt_to_padded_dense(jt, None, 0.0).shape == (3, 3)
    rows_2d = RefJT((1, 0), ((1, 2),), None, "float16", "int32", dim=2)
    assert jt_to_padded_dense(rows_2d, 2, 0.0) == Array((2, 2, 2), (1, 2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), "float16")


def test_from_dense_lengths_keeps_the_first_entries_of_each_row():
    out = jt_from_dense_lengths([(1, 2, 3), (4, 5, 6)], (2, 0), [(0.1, 0.2, 0.3), (0.4, 0.5, 0.6)], "int64", "int64", "float32")
    assert (out.values, out.weights, out.offsets()) == ((1, 2), (0.1, 0.2), [0, 2, 2])


def test_regroup_takes_each_key_from_the_keyed_tensor_that_holds_it():
    first = RefKT(("a", "b"), (1, 2), ((1, 2, 3), (4, 5, 6)), "float32")
    second = RefKT(("c",), (1,), ((7,), (8,)), "float32")
    groups = kt_regroup([first, second], [["c", "b"], ["a", "c"]])
    assert groups[0] == Array((2, 3), (7, 2, 3, 8, 5, 6), "float32")
    assert groups[1] == Array((2, 2), (1, 7, 4, 8), "float32")
    keyed_rows = RefKT(("a", "b"), (1, 2), ((1, 2), (3, 4), (5, 6)), "float32", key_dim=0)
    assert kt_getitem(keyed_rows, "b") == Array((2, 2), (3, 4, 5, 6), "float32")


def test_reference_gradient_sums_the_upstream_of_every_output_carrying_a_tag():
    tags = Array((4,), (("x", 1), None, ("x", 1), ("x", 0)), None)
    assert reference_grad([(tags, (0.25, 8.0, -1.0, 2.0))], "x", 3) == (2.0, -0.75, 0.0)
    many = Array((MAX_SUMMED_TERMS + 1,), (("x", 0),) * (MAX_SUMMED_TERMS + 1), None)
    with pytest.raises(HarnessError, match="exact sums"):
        reference_grad([(many, (1.0,) * (MAX_SUMMED_TERMS + 1))], "x", 1)


def test_dyadic_upstream_sums_are_exact_in_float16_up_to_the_bound():
    largest = UPSTREAM_MAX_STEPS * UPSTREAM_STEP
    terms = [largest] * (MAX_SUMMED_TERMS - 1) + [-UPSTREAM_STEP]
    assert torch.tensor(terms, dtype=torch.float16).sum().item() == sum(terms)
    assert round_to("float16", 127.9375) == 127.9375 and round_to("float16", 2049.0) == 2048.0


def test_tags_name_every_number_of_a_2d_value():
    tagged = tag_jt(RefJT((1,), ((1.0, 2.0),), (0.5,), "float32", "int64", "float32", dim=2), "v")
    assert tagged.values == ((("v", 0), ("v", 1)),) and tagged.weights == (("v.weights", 0),)


def test_expect_array_names_the_element_dtype_and_shape_that_differ():
    expected = Array((3,), (1.0, 2.0, 3.0), "float32")
    expect_array(torch.tensor([1.0, 2.0, 3.0]), expected, "op")
    with pytest.raises(ParityError, match=r"op\[2\]"):
        expect_array(torch.tensor([1.0, 2.0, 4.0]), expected, "op")
    with pytest.raises(ParityError, match="dtype float64 where the reference has float32"):
        expect_array(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), expected, "op")
    with pytest.raises(ParityError, match=r"shape \(2,\)"):
        expect_array(torch.tensor([1.0, 2.0]), expected, "op")
    with pytest.raises(ParityError, match="torchrec gives None"):
        expect_array(None, expected, "op")
    with pytest.raises(ParityError, match="bit"):  # -0.0 is not 0.0 bit for bit
        expect_array(torch.tensor([1.0, 2.0, -0.0]), Array((3,), (1.0, 2.0, 0.0), "float32"), "op")


def test_offsets_of_no_rows_may_be_empty_or_a_single_zero_but_nothing_else():
    expect_offsets(torch.tensor([], dtype=torch.int64), (), "o")
    expect_offsets(torch.tensor([0]), (), "o")
    with pytest.raises(ParityError):
        expect_offsets(torch.tensor([], dtype=torch.int64), (1,), "o")


def test_expect_jt_fails_on_a_moved_weight():
    from torchrec.sparse.jagged_tensor import JaggedTensor

    ref = RefJT((1, 1), (3, 4), (0.5, 1.5), "int64", "int64", "float32")
    jt = JaggedTensor(values=torch.tensor([3, 4]), lengths=torch.tensor([1, 1]), weights=torch.tensor([1.5, 0.5]))
    with pytest.raises(ParityError, match=r"jt.weights_or_none\(\)\[0\]"):
        expect_jt(jt, ref, "jt")


def _raw(**changes):
    from paritykit.checks.sparse_ops.reference_validity import RawKJT

    # keys a, b; batch of 2: a's rows [10], [11, 12]; b's rows [], [20]
    base = dict(keys=("a", "b"), values=(10, 11, 12, 20), lengths=(1, 2, 0, 1), offsets=(0, 1, 3, 3, 4), weights=4, stride=2,
                strides=None)
    return RawKJT(**{**base, **changes})


@pytest.mark.parametrize("changes, problem", [
    ({}, None),
    ({"offsets": None}, None),
    ({"lengths": None, "stride": None}, None),
    ({"stride": None, "strides": ((2,), (2,))}, None),
    ({"lengths": (2, 1, 0, 1), "offsets": None}, None),  # another valid batch
    ({"lengths": None, "offsets": None}, "neither lengths nor offsets"),
    ({"lengths": (-1, 4, 0, 1), "offsets": None}, "lengths[0] = -1 is negative"),
    ({"lengths": None, "offsets": (0, 4, 3, 3, 4)}, "offsets decrease at 2 (4 -> 3)"),
    ({"offsets": (1, 1, 3, 3, 4)}, "offsets start at 1, not 0"),
    ({"lengths": (2, 1, 0, 1)}, "the offsets are not the cumulative sum of the lengths"),
    ({"keys": ("a", "a")}, "keys repeat: ['a', 'a']"),
    ({"stride": 1}, "4 rows are not 2 keys of the batch size 1"),
    ({"weights": 3}, "3 weights for 4 values"),
    ({"stride": None, "strides": ((4,),)}, "samples given for 1 keys, not the 2 keys"),
    ({"stride": None, "strides": ((2, 0), (2, 0))}, "samples per key for several ranks (user input is one rank's)"),
    ({"stride": None, "strides": ((2,), (3,))}, "samples per key sum to 5, not the 4 rows"),
    ({"keys": (), "stride": None}, "no keys but 4 rows"),
])
def test_validity_reference_names_the_one_rule_a_kjt_breaks(changes, problem):
    from paritykit.checks.sparse_ops.reference_validity import kjt_problems

    assert kjt_problems(_raw(**changes))[:1] == ([] if problem is None else [problem])


def test_ids_out_of_range_are_named_per_key_a_table_serves():
    from paritykit.checks.sparse_ops.reference_validity import ids_per_key, out_of_range

    assert ids_per_key(_raw()) == {"a": (10, 11, 12), "b": (20,)}
    assert out_of_range(_raw(), {"a": 13, "b": 20}) == ["b: ids 20..20 outside [0, 20)"]
    assert out_of_range(_raw(), {"a": 13}) == []
