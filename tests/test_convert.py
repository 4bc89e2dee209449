"""paritykit.convert: round trips, agreement with torchrec where torchrec is defined, its shortfalls,
bad input, and proof that conversion and the KJT consumers after it read no lengths/offsets data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from tensordict import TensorDict
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.tensor_dict import maybe_td_to_kjt

from paritykit.compare import assert_close
from paritykit.convert import VALUES_KEY, WEIGHTS_KEY, kjt_to_td, td_to_kjt
from paritykit.strategies import CONTIGUOUS_FORMS, JAGGED_FORMS, SparseBatch, jagged_forms, key_selections, sparse_batches


def njt(values, offsets):
    return torch.nested.nested_tensor_from_jagged(torch.tensor(values), offsets=torch.tensor(offsets))


class HostReads(TorchFunctionMode):
    """Records every read of tensor data into host Python values (what is a device->host sync on GPU).

    Python-level reads (tolist, item, bool(), ...) are seen as torch functions; reads inside C++
    (e.g. an op that needs a data-dependent size) as aten._local_scalar_dense. Tensors in ``host``
    are host metadata by construction (a KJT's stride_per_key_per_rank), so reading them is free.
    """

    READS = frozenset({"tolist", "item", "numpy", "cpu", "equal", "__bool__", "__int__", "__float__", "__index__"})

    def __init__(self, host: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._host = {id(t) for t in host}
        self._inside_read = 0
        self._dispatch = _ScalarReads(self)

    def __enter__(self):
        self._dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._dispatch.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        is_read = name in self.READS and args and isinstance(args[0], torch.Tensor) and id(args[0]) not in self._host
        if is_read:
            self.reads.append(name)
            self._inside_read += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            if is_read:
                self._inside_read -= 1


class _ScalarReads(TorchDispatchMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.owner._inside_read:
            self.owner.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def use_like_a_model(kjt: KeyedJaggedTensor) -> None:
    """What EBC/EC forward and sharded input_dist ask of a KJT's metadata."""
    kjt.length_per_key()
    kjt.offset_per_key()
    kjt.stride_per_key()
    kjt.to_dict()
    kjt.split([1, len(kjt.keys()) - 1])
    order = list(reversed(range(len(kjt.keys()))))
    # With its indices tensor prepared ahead, as sharded modules do; building it here would be a copy.
    kjt.permute(order, torch.tensor(order, dtype=torch.int))


# ---------------------------------------------------------------- round trips and oracles


@given(batch=sparse_batches(), form=jagged_forms())
def test_td_to_kjt_equals_the_kjt_built_from_the_same_rows(batch: SparseBatch, form: str) -> None:
    kjt = td_to_kjt(batch.to_td(form))
    assert_close(kjt, batch.to_kjt(lengths_dtype=batch.kjt_lengths_dtype(form)), exact=True)
    # The metadata was set at construction, from shapes, and is right.
    assert kjt._length_per_key == batch.length_per_key
    assert kjt._offset_per_key == [sum(batch.length_per_key[:i]) for i in range(len(batch.keys) + 1)]
    assert kjt._stride_per_key == batch.batch_sizes
    assert kjt.variable_stride_per_key() == batch.variable_batch
    if batch.variable_batch:
        assert kjt.stride_per_key_per_rank() == [[b] for b in batch.batch_sizes]


@given(batch=sparse_batches(min_batch_size=0), form=jagged_forms(contiguous_only=True))
def test_kjt_to_td_of_td_to_kjt_is_the_td(batch: SparseBatch, form: str) -> None:
    # torch.nested cannot build a jagged tensor with no rows from a list of rows.
    assume(min(batch.batch_sizes) > 0 or form.startswith("from_jagged"))
    td = batch.to_td(form)
    assert_close(kjt_to_td(td_to_kjt(td)), td, exact=True)


@given(batch=sparse_batches(min_batch_size=0))
def test_td_to_kjt_of_kjt_to_td_is_the_kjt(batch: SparseBatch) -> None:
    kjt = batch.to_kjt()
    back = td_to_kjt(kjt_to_td(kjt))
    assert_close(back, kjt, exact=True)
    assert back.length_per_key() == kjt.length_per_key()


@given(batch=sparse_batches(min_keys=20, max_keys=64, max_batch_size=3, max_length=2))
def test_round_trip_with_many_keys(batch: SparseBatch) -> None:
    kjt = batch.to_kjt()
    assert_close(td_to_kjt(kjt_to_td(kjt)), kjt, exact=True)


def test_weights_convention_is_a_sub_tensordict_sharing_the_ids_offsets() -> None:
    batch = SparseBatch(keys=("a", "b"), lengths=((2, 0, 1), (1, 1, 1)), id_bounds=(10, 10), seed=3, weighted=True)
    td = kjt_to_td(batch.to_kjt())
    assert list(td.keys()) == ["a", "b"]
    assert set(td["a"].keys()) == {VALUES_KEY, WEIGHTS_KEY}
    assert td["a"][WEIGHTS_KEY].offsets() is td["a"][VALUES_KEY].offsets()
    assert torch.equal(td["a"][WEIGHTS_KEY].values(), batch.weights("a"))


@given(data=st.data())
def test_keys_argument_selects_any_subset_in_any_order(data: st.DataObject) -> None:
    batch = data.draw(sparse_batches(min_keys=2))
    selection = data.draw(key_selections(batch.keys))
    form = data.draw(jagged_forms())
    expected = batch.to_kjt(lengths_dtype=batch.kjt_lengths_dtype(form), keys=selection)
    assert_close(td_to_kjt(batch.to_td(form), keys=selection), expected, exact=True)


def test_empty_tensordict_gives_an_empty_kjt() -> None:
    kjt = td_to_kjt(TensorDict({}, batch_size=[]))
    assert kjt.keys() == [] and kjt.values().numel() == 0
    assert list(kjt_to_td(kjt).keys()) == []


# ---------------------------------------------------------------- agreement with torchrec


@given(batch=sparse_batches(weighted=False, variable_batch=False), form=jagged_forms(contiguous_only=True), data=st.data())
def test_agrees_with_torchrec_maybe_td_to_kjt_where_that_is_defined(batch: SparseBatch, form: str, data) -> None:
    td = batch.to_td(form)
    keys = data.draw(st.one_of(st.none(), key_selections(batch.keys)))
    ours, theirs = td_to_kjt(td, keys), maybe_td_to_kjt(td, keys)
    assert_close(ours, theirs, exact=True)
    assert ours.length_per_key() == theirs.length_per_key()
    assert ours.offset_per_key() == theirs.offset_per_key()


# ---------------------------------------------------------------- torchrec's shortfalls (docs/td-kjt.md)


def test_shortfall_torchrec_refuses_weighted_features() -> None:
    batch = SparseBatch(keys=("a",), lengths=((2, 1),), id_bounds=(10,), seed=0, weighted=True)
    td = batch.to_td()
    with pytest.raises(AttributeError, match="_values"):
        maybe_td_to_kjt(td)
    assert_close(td_to_kjt(td).weights(), batch.weights("a"), exact=True)


def test_shortfall_torchrec_reads_variable_batch_as_another_batch() -> None:
    # "a" has 3 rows, "b" has 1: torchrec infers stride 4 // 2 = 2 and moves a's third row into b.
    td = TensorDict({"a": njt([1, 2, 3], [0, 1, 2, 3]), "b": njt([7, 8], [0, 2])}, batch_size=[])
    theirs = maybe_td_to_kjt(td).to_dict()
    ours = td_to_kjt(td).to_dict()
    assert theirs["a"].lengths().tolist() == [1, 1] and theirs["b"].lengths().tolist() == [1, 2]
    assert ours["a"].lengths().tolist() == [1, 1, 1] and ours["b"].lengths().tolist() == [2]
    assert ours["b"].values().tolist() == [7, 8]


@pytest.mark.parametrize("form", [f for f in JAGGED_FORMS if f not in CONTIGUOUS_FORMS])
def test_shortfall_torchrec_leaks_the_buffer_of_a_non_contiguous_jagged_tensor(form: str) -> None:
    batch = SparseBatch(keys=("a", "b"), lengths=((2, 1), (1, 1)), id_bounds=(10, 10), seed=1)
    td = batch.to_td(form)
    expected = batch.to_kjt(lengths_dtype=batch.kjt_lengths_dtype(form))
    assert_close(td_to_kjt(td), expected, exact=True)
    theirs = maybe_td_to_kjt(td)
    # torchrec concatenates whole buffers, gaps included (-1 fills them), under the row lengths.
    assert theirs.values().numel() > expected.values().numel()
    assert -1 in theirs.values()[: expected.length_per_key()[0]].tolist()
    assert theirs.lengths().tolist() == expected.lengths().tolist()


def test_shortfall_torchrec_leaves_metadata_to_be_read_from_the_lengths() -> None:
    td = SparseBatch(keys=("a", "b", "c"), lengths=((1, 2), (0, 3), (2, 2)), id_bounds=(9, 9, 9), seed=2).to_td()
    theirs = maybe_td_to_kjt(td)
    assert theirs._length_per_key is None and theirs._offset_per_key is None
    with HostReads() as reads:
        use_like_a_model(theirs)
    assert len(reads.reads) >= 1, "the host-read recorder must see torchrec's read of the lengths"
    ours = td_to_kjt(td)
    with HostReads() as reads:
        use_like_a_model(ours)
    assert reads.reads == []


# ---------------------------------------------------------------- no device data read


@given(batch=sparse_batches(min_keys=2), form=jagged_forms(contiguous_only=True))
def test_conversion_and_model_use_read_no_lengths_or_offsets(batch: SparseBatch, form: str) -> None:
    td = batch.to_td(form)
    with HostReads() as reads:
        kjt = td_to_kjt(td)
    assert reads.reads == []
    with HostReads(host=(kjt._stride_per_key_per_rank,) if batch.variable_batch else ()) as reads:
        use_like_a_model(kjt)
    assert reads.reads == []


@given(batch=sparse_batches())
def test_conversion_works_on_the_meta_device_where_no_data_exists(batch: SparseBatch) -> None:
    # Meta tensors have shapes and no data: any read of lengths/offsets would raise.
    real = batch.to_td()
    meta = TensorDict(
        {key: _to_meta(real.get(key)) for key in batch.keys},
        batch_size=[],
    )
    kjt = td_to_kjt(meta)
    assert kjt.values().is_meta and kjt.lengths().is_meta
    assert kjt.length_per_key() == batch.length_per_key
    assert kjt.stride_per_key() == batch.batch_sizes


def _to_meta(entry):
    if isinstance(entry, TensorDict):
        ids = _to_meta(entry.get(VALUES_KEY))
        weights = torch.nested.nested_tensor_from_jagged(
            entry.get(WEIGHTS_KEY).values().to("meta"), offsets=ids.offsets()
        )
        return TensorDict({VALUES_KEY: ids, WEIGHTS_KEY: weights}, batch_size=[])
    return torch.nested.nested_tensor_from_jagged(entry.values().to("meta"), offsets=entry.offsets().to("meta"))


def test_non_contiguous_features_cost_one_read_in_all() -> None:
    batch = SparseBatch(keys=("a", "b", "c"), lengths=((2, 1), (1, 3), (0, 2)), id_bounds=(9, 9, 9), seed=4)
    td = batch.to_td("narrow")
    with HostReads() as reads:
        td_to_kjt(td)
    assert reads.reads == ["tolist"]


# ---------------------------------------------------------------- bad input names the feature at fault


def _td(**entries) -> TensorDict:
    return TensorDict(entries, batch_size=[])


@pytest.mark.parametrize(
    "td, keys, error, pattern",
    [
        (_td(a=njt([1], [0, 1])), ["a", "zz"], KeyError, r"\['zz'\]"),
        (_td(a=njt([1], [0, 1])), ["a", "a"], ValueError, r"\['a'\].*more than once"),
        (_td(a=njt([1], [0, 1]), b=torch.tensor([1, 2])), None, TypeError, r"'b'.*not nested"),
        (_td(a=torch.nested.nested_tensor([torch.tensor([1])])), None, TypeError, r"'a'.*torch.strided"),
        (_td(a=torch.nested.nested_tensor([torch.ones(2, 3)], layout=torch.jagged)), None, ValueError, r"'a'.*shape"),
        (_td(a=torch.nested.nested_tensor([torch.ones(2)], layout=torch.jagged)), None, TypeError, r"'a'.*integers"),
        (_td(a=njt([1], [0, 1]), b=torch.nested.nested_tensor([torch.tensor([1], dtype=torch.int32)], layout=torch.jagged)),
         None, TypeError, r"'b'.*int32.*'a'"),
        (_td(a=_td(values=njt([1], [0, 1]), weights=torch.nested.nested_tensor([torch.ones(1)], layout=torch.jagged)),
             b=njt([1], [0, 1])), None, ValueError, r"\['b'\] have no weights"),
        (_td(a=_td(values=njt([1], [0, 1]), weights=torch.nested.nested_tensor([torch.ones(1)] * 2, layout=torch.jagged))),
         None, ValueError, r"'a'.*batch size 2"),
        (_td(a=_td(values=njt([1, 2], [0, 1, 2]), weights=torch.nested.nested_tensor([torch.ones(2), torch.ones(0)], layout=torch.jagged))),
         None, ValueError, r"'a'.*different row lengths"),
        (_td(a=_td(values=njt([1], [0, 1]), scale=njt([1], [0, 1]))), None, ValueError, r"'a'.*\['scale', 'values'\]"),
    ],
)
def test_bad_input_raises_naming_the_feature(td, keys, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        td_to_kjt(td, keys)


def test_kjt_to_td_refuses_a_kjt_with_several_ranks_per_key() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(4), lengths=torch.tensor([1, 0, 1, 1, 1]),
        stride_per_key_per_rank=[[1, 1], [2, 1]],
    )
    with pytest.raises(ValueError, match=r"\['a', 'b'\].*2 ranks each"):
        kjt_to_td(kjt)


def test_non_tensordict_and_non_kjt_inputs_are_refused() -> None:
    with pytest.raises(TypeError, match="expects a TensorDict, got dict"):
        td_to_kjt({"a": njt([1], [0, 1])})
    with pytest.raises(TypeError, match="expects a KeyedJaggedTensor"):
        kjt_to_td(_td(a=njt([1], [0, 1])))


@pytest.mark.gpu
@given(batch=sparse_batches(), form=jagged_forms())
def test_cuda_round_trip_and_no_reads(batch: SparseBatch, form: str) -> None:
    from paritykit.sync import count_syncs

    td = batch.to_td(form, device="cuda")
    with count_syncs(backend="cuda") as record:
        kjt = td_to_kjt(td)
        use_like_a_model(kjt) if len(batch.keys) > 1 else None
    assert record.total == (0 if form in CONTIGUOUS_FORMS else 1)
    assert_close(kjt.to("cpu"), batch.to_kjt(lengths_dtype=batch.kjt_lengths_dtype(form)), exact=True)


def test_sync_guard_sees_torchrecs_read_and_none_of_ours() -> None:
    from paritykit.sync import count_syncs, sync_guard

    td = SparseBatch(keys=("a", "b", "c"), lengths=((1, 2), (0, 3), (2, 2)), id_bounds=(9, 9, 9), seed=5).to_td()
    theirs = maybe_td_to_kjt(td)
    with count_syncs(backend="cpu") as record:
        use_like_a_model(theirs)
    assert record.total == 1
    with sync_guard(max_syncs=0, backend="cpu"):
        use_like_a_model(td_to_kjt(td))
