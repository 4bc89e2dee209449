"""paritykit.compare: every kind of structure passes when equal and fails with the right message."""

import tempfile

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from paritykit.compare import assert_close, find_differences, max_abs_diff
from paritykit.errors import ParityError


def kjt(values, lengths, keys=("f1", "f2"), weights=None):
    return KeyedJaggedTensor.from_lengths_sync(
        list(keys), torch.tensor(values), torch.tensor(lengths), weights=None if weights is None else torch.tensor(weights)
    )


def jagged(*rows):
    return torch.nested.nested_tensor([torch.tensor(r, dtype=torch.int64) for r in rows], layout=torch.jagged)


# ------------------------------------------------------------------ tensors


def test_equal_tensors_pass():
    t = torch.randn(3, 4)
    assert_close(t, t.clone())
    assert_close(t, t.clone(), exact=True)


def test_value_difference_names_index_expected_actual_and_counts():
    expected = torch.zeros(5, 3)
    actual = expected.clone()
    actual[4, 2] = 0.5
    with pytest.raises(ParityError) as info:
        assert_close({"ebc.t0.weight": actual}, {"ebc.t0.weight": expected})
    message = str(info.value)
    assert "state['ebc.t0.weight'][4, 2]: 0.5 vs 0.0" in message
    assert "1 of 15 elements differ" in message
    assert "max abs error 0.5" in message


def test_shape_and_dtype_are_structure_differences():
    with pytest.raises(ParityError, match=r"\[structure\] value: shape \(2,\) vs \(3,\)"):
        assert_close(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ParityError, match=r"\[structure\] value: dtype torch.int32 vs torch.int64"):
        assert_close(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))


def test_integers_are_exact_even_with_tolerance():
    with pytest.raises(ParityError, match="1 vs 2"):
        assert_close(torch.tensor([1]), torch.tensor([2]), rtol=1.0, atol=1.0)


def test_float_default_tolerance_is_torch_testing_per_dtype():
    base = torch.ones(4)
    assert_close(base + 5e-7, base)  # within float32 defaults (rtol 1.3e-6, atol 1e-5)
    with pytest.raises(ParityError):
        assert_close(base + 1e-3, base)
    half = torch.ones(4, dtype=torch.float16)
    assert_close(half * (1 + 2**-11), half)  # one ulp of fp16 is within its rtol 1e-3


def test_explicit_tolerance_overrides_default_and_needs_both():
    assert_close(torch.tensor([1.0]), torch.tensor([1.05]), rtol=0.0, atol=0.1)
    with pytest.raises(ValueError, match="both rtol and atol"):
        assert_close(torch.tensor([1.0]), torch.tensor([1.0]), rtol=0.1)


def test_exact_mode_is_bitwise():
    one_ulp = torch.nextafter(torch.tensor([1.0]), torch.tensor([2.0]))
    assert_close(one_ulp, torch.tensor([1.0]))  # close
    with pytest.raises(ParityError, match="compared bit for bit"):
        assert_close(one_ulp, torch.tensor([1.0]), exact=True)


def test_negative_zero_equals_zero_except_in_exact_mode():
    assert_close(torch.tensor([-0.0]), torch.tensor([0.0]))
    with pytest.raises(ParityError, match=r"-0.0 vs 0.0"):
        assert_close(torch.tensor([-0.0]), torch.tensor([0.0]), exact=True)


def test_nan_equals_nan_in_the_same_position_only():
    nan = float("nan")
    assert_close(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))
    assert_close(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]), exact=True)
    with pytest.raises(ParityError, match="NaNs: actual 1, expected 0"):
        assert_close(torch.tensor([nan, 1.0]), torch.tensor([0.0, 1.0]))


def test_infinities_match_only_same_sign():
    inf = float("inf")
    assert_close(torch.tensor([inf, -inf]), torch.tensor([inf, -inf]))
    with pytest.raises(ParityError):
        assert_close(torch.tensor([inf]), torch.tensor([-inf]))


def test_max_abs_diff_is_the_largest_error_and_zero_when_equal():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert max_abs_diff(a, a.clone()) == 0.0
    assert max_abs_diff(a + torch.tensor([0.0, 0.25, -0.5]), a) == 0.5


# ------------------------------------------------------------------ torchrec structures


def test_kjt_equal_passes():
    assert_close(kjt([1, 2, 3, 4], [1, 1, 0, 2]), kjt([1, 2, 3, 4], [1, 1, 0, 2]), exact=True)


def test_kjt_value_difference_is_located_per_key():
    with pytest.raises(ParityError, match=r"kjt\['f2'\].values\[1\]: 4 vs 9"):
        assert_close(kjt([1, 2, 3, 4], [1, 1, 0, 2]), kjt([1, 2, 3, 9], [1, 1, 0, 2]))


def test_kjt_key_order_missing_key_and_lengths_are_structure():
    with pytest.raises(ParityError, match=r"\[structure\] kjt: key order \['f2', 'f1'\] vs \['f1', 'f2'\]"):
        assert_close(kjt([1, 2], [1, 1], keys=("f2", "f1")), kjt([1, 2], [1, 1]))
    with pytest.raises(ParityError, match=r"missing \['f2'\], unexpected \['f3'\]"):
        assert_close(kjt([1, 2], [1, 1], keys=("f1", "f3")), kjt([1, 2], [1, 1]))
    with pytest.raises(ParityError, match=r"\[structure\] kjt\['f1'\].lengths"):
        assert_close(kjt([1, 2], [2, 0, 0, 0]), kjt([1, 2], [1, 1, 0, 0]))


def test_kjt_stride_and_weights_presence_are_structure():
    with pytest.raises(ParityError, match=r"kjt.stride: 1 vs 2"):
        assert_close(kjt([1, 2], [1, 1]), kjt([1, 2], [1, 0, 1, 0]))
    with pytest.raises(ParityError, match=r"kjt.weights: present vs absent"):
        assert_close(kjt([1, 2], [1, 1], weights=[0.5, 0.5]), kjt([1, 2], [1, 1]))


def test_malformed_kjt_is_a_structure_difference_not_a_crash():
    malformed = KeyedJaggedTensor(keys=["f1"], values=torch.arange(5), lengths=torch.tensor([1, 2]))
    with pytest.raises(ParityError, match="actual KJT holds 5 values but its lengths sum to 3"):
        assert_close(malformed, kjt([0, 1, 2], [1, 2], keys=("f1",)))


def test_kjt_weight_difference_is_a_value_difference():
    with pytest.raises(ParityError, match=r"\[value\] kjt\['f2'\].weights"):
        assert_close(kjt([1, 2], [1, 1], weights=[0.5, 0.5]), kjt([1, 2], [1, 1], weights=[0.5, 0.25]))


def test_kjt_variable_stride_per_key():
    def vbe(lengths):
        return KeyedJaggedTensor(
            keys=["f1", "f2"],
            values=torch.arange(sum(lengths)),
            lengths=torch.tensor(lengths),
            stride_per_key_per_rank=[[1], [2]],
        )

    assert_close(vbe([2, 1, 1]), vbe([2, 1, 1]))
    with pytest.raises(ParityError, match="stride_per_key_per_rank"):
        assert_close(
            vbe([2, 1, 1]),
            KeyedJaggedTensor(keys=["f1", "f2"], values=torch.arange(4), lengths=torch.tensor([2, 1, 1]), stride_per_key_per_rank=[[2], [1]]),
        )
    with pytest.raises(ParityError, match="variable stride per key True vs False"):
        assert_close(vbe([1, 1, 0, 0]), kjt([0, 1], [1, 1, 0, 0]))


def test_jagged_tensor_compares_lengths_values_weights():
    jt = JaggedTensor(values=torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([2, 1]))
    assert_close(jt, JaggedTensor(values=torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([2, 1])))
    with pytest.raises(ParityError, match=r"\[structure\] jt.lengths"):
        assert_close(jt, JaggedTensor(values=torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([1, 2])))
    with pytest.raises(ParityError, match=r"jt.values\[2\]: 3.0 vs 4.0"):
        assert_close(jt, JaggedTensor(values=torch.tensor([1.0, 2.0, 4.0]), lengths=torch.tensor([2, 1])))


def test_keyed_tensor_locates_key_and_index():
    values = torch.arange(10.0).view(2, 5)
    other = values.clone()
    other[1, 3] = -1.0
    kt = KeyedTensor(["a", "b"], [2, 3], values)
    assert_close(kt, KeyedTensor(["a", "b"], [2, 3], values.clone()))
    with pytest.raises(ParityError, match=r"kt\['b'\]\[1, 1\]: 8.0 vs -1.0"):
        assert_close(kt, KeyedTensor(["a", "b"], [2, 3], other))
    with pytest.raises(ParityError, match=r"kt.length_per_key: \[2, 3\] vs \[3, 2\]"):
        assert_close(kt, KeyedTensor(["a", "b"], [3, 2], values.clone()))


# ------------------------------------------------------------------ tensordict and nested tensors


def test_tensordict_of_jagged_leaves():
    td = TensorDict({"f1": jagged([1, 2], [3]), "f2": jagged([], [4])}, batch_size=[2])
    assert_close(td, TensorDict({"f1": jagged([1, 2], [3]), "f2": jagged([], [4])}, batch_size=[2]), exact=True)
    with pytest.raises(ParityError, match=r"\[structure\] td\['f1'\].lengths"):
        assert_close(td, TensorDict({"f1": jagged([1], [2, 3]), "f2": jagged([], [4])}, batch_size=[2]))
    with pytest.raises(ParityError, match=r"td\['f2'\].values\[0\]: 4 vs 5"):
        assert_close(td, TensorDict({"f1": jagged([1, 2], [3]), "f2": jagged([], [5])}, batch_size=[2]))
    with pytest.raises(ParityError, match=r"key order"):
        assert_close(td, TensorDict({"f2": jagged([], [4]), "f1": jagged([1, 2], [3])}, batch_size=[2]))


# ------------------------------------------------------------------ containers


def test_mapping_reports_missing_and_extra_keys_and_still_compares_common_ones():
    differences = find_differences({"a": torch.zeros(1), "c": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)})
    assert [d.kind for d in differences] == ["structure", "value"]
    assert "missing ['b'], unexpected ['c']" in differences[0].detail
    assert differences[1].path == "state['a']"


def test_sequences_and_scalars():
    assert_close([torch.zeros(1), 3, "x"], [torch.zeros(1), 3, "x"])
    with pytest.raises(ParityError, match=r"value\[1\]: 3 vs 4"):
        assert_close([torch.zeros(1), 3], [torch.zeros(1), 4])
    with pytest.raises(ParityError, match="length 1 vs 2"):
        assert_close([1], [1, 2])
    with pytest.raises(ParityError, match="type KeyedJaggedTensor vs Tensor"):
        assert_close(kjt([1], [1, 0]), torch.zeros(1))


def test_many_differences_are_capped_and_said_so():
    differences = {f"t{i}": torch.tensor([float(i)]) for i in range(20)}
    with pytest.raises(ParityError, match="at least 10 differences"):
        assert_close(differences, {k: v + 1 for k, v in differences.items()})


def test_msg_is_prefixed():
    with pytest.raises(ParityError, match="^step 3 outputs\n"):
        assert_close(torch.zeros(1), torch.ones(1), msg="step 3 outputs")


def test_parity_error_is_an_assertion_error():
    assert issubclass(ParityError, AssertionError)


# ------------------------------------------------------------------ distributed state dicts


@pytest.fixture
def single_rank_group():
    with tempfile.TemporaryDirectory() as store_dir:
        dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_dtensor_against_full_tensor_compares_its_local_shard(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).view(4, 3)
    dtensor = distribute_tensor(full.clone(), mesh, [Shard(0)])
    assert_close({"w": dtensor}, {"w": full})
    wrong = full.clone()
    wrong[2, 1] = 100.0
    with pytest.raises(ParityError, match=r"state\['w'\]<shard@\[0, 0\]>\[2, 1\]: 7.0 vs 100.0"):
        assert_close({"w": dtensor}, {"w": wrong})


def test_sharded_tensor_against_full_tensor_uses_shard_offsets(single_rank_group):
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    full = torch.arange(8.0).view(4, 2)
    shards = [Shard(full.clone(), ShardMetadata(shard_offsets=[0, 0], shard_sizes=[4, 2], placement="rank:0/cpu"))]
    sharded = init_from_local_shards(shards, [4, 2])
    assert_close(sharded, full)
    with pytest.raises(ParityError, match=r"global shape \(4, 2\) vs \(2, 4\)"):
        assert_close(sharded, full.view(2, 4))
