"""The CPU proxy: which operations count, of which kind, and which tensors stand for host tensors."""

from __future__ import annotations

import numpy  # noqa: F401  (Tensor.numpy needs it importable)
import pytest
import torch

from paritykit.sync import count_syncs, on_host
from paritykit.sync.cpu import HostTensor, is_host


def _count(fn, x):
    with count_syncs(backend="cpu") as rec:
        fn(x)
    return rec.total, rec.by_kind


# Each operation reads device data on the host once (it synchronizes on a GPU): (name, op, kind).
SYNCING_OPS = [
    ("item", lambda x: x[0].item(), "item"),
    ("tolist", lambda x: x.tolist(), "tolist"),
    ("bool", lambda x: bool(x[0]), "scalar"),
    ("int", lambda x: int(x[0]), "scalar"),
    ("float", lambda x: float(x[0]), "scalar"),
    ("index", lambda x: [10, 20, 30][x[1]], "scalar"),
    ("if-tensor", lambda x: 1 if x[2] else 0, "scalar"),
    ("equal", lambda x: torch.equal(x, x), "scalar"),
    ("numpy", lambda x: x.numpy(), "numpy"),
    ("cpu", lambda x: x.cpu(), "d2h-copy"),
    ("copy-into-host", lambda x: on_host(torch.empty(3, dtype=x.dtype)).copy_(x), "d2h-copy"),
    ("nonzero", lambda x: torch.nonzero(x), "data-dependent"),
    ("nonzero-method", lambda x: x.nonzero(), "data-dependent"),
    ("masked_select", lambda x: torch.masked_select(x, x > 0), "data-dependent"),
    ("unique", lambda x: torch.unique(x), "data-dependent"),
    ("unique-method", lambda x: x.unique(), "data-dependent"),
    ("repeat_interleave", lambda x: torch.repeat_interleave(x, x), "data-dependent"),
    ("repeat_interleave-repeats-only", lambda x: torch.repeat_interleave(x), "data-dependent"),
    ("bool-mask-index", lambda x: x[x > 0], "data-dependent"),
    ("bool-mask-assign", lambda x: x.clone().__setitem__(x > 0, 0), "data-dependent"),
    ("where-one-arg", lambda x: torch.where(x > 0), "data-dependent"),
]


@pytest.mark.parametrize("name,op,kind", SYNCING_OPS, ids=[c[0] for c in SYNCING_OPS])
def test_each_syncing_op_on_a_device_tensor_counts_once_with_its_kind(name, op, kind):
    x = torch.tensor([0, 2, 1])
    assert _count(op, x) == (1, {kind: 1})


# Host-to-host copy_ is covered by test_copies_between_host_and_device.
HOST_OPS = [c for c in SYNCING_OPS if c[0] != "copy-into-host"]


@pytest.mark.parametrize("name,op,kind", HOST_OPS, ids=[c[0] for c in HOST_OPS])
def test_the_same_op_on_a_host_tensor_counts_nothing(name, op, kind):
    x = on_host(torch.tensor([0, 2, 1]))
    assert _count(op, x) == (0, {})


_LONG_INDEX = torch.tensor([0, 2])  # made outside any block: a device tensor

NON_SYNCING_OPS = [
    ("arith", lambda x: (x * 2 + 1).sum()),
    ("long-index", lambda x: x[_LONG_INDEX]),
    ("int-index-and-slice", lambda x: (x[1], x[1:])),
    ("repeat_interleave-output_size", lambda x: torch.repeat_interleave(x, x, output_size=3)),
    ("repeat_interleave-int", lambda x: x.repeat_interleave(2)),
    ("where-three-args", lambda x: torch.where(x > 0, x, 0)),
    ("to-device", lambda x: x.to(torch.device("cpu"))),
    ("shape", lambda x: (x.shape[0], len(x), x.numel())),
]


@pytest.mark.parametrize("name,op", NON_SYNCING_OPS, ids=[c[0] for c in NON_SYNCING_OPS])
def test_ops_that_do_not_read_device_data_count_nothing(name, op):
    assert _count(op, torch.tensor([0, 2, 1])) == (0, {})


def test_host_marking_propagates_through_ops_and_ends_at_the_move_to_device():
    host = on_host(torch.tensor([1, 2, 3]))
    derived = torch.cat([host, host]).sum(dim=0, keepdim=True)
    assert is_host(derived)
    moved = host.to(torch.device("cpu"), non_blocking=True)
    assert not is_host(moved) and moved.data_ptr() == host.data_ptr()
    assert is_host(torch.arange(2).cpu()) is False  # outside a block .cpu() is plain torch


def test_copies_between_host_and_device():
    host = on_host(torch.tensor([1, 2, 3]))
    device = torch.tensor([4, 5, 6], device=torch.device("cpu"))
    with count_syncs(backend="cpu") as rec:
        host.to(torch.device("cpu"))  # blocking host->device copy
        host.to(torch.device("cpu"), non_blocking=True)  # async: no sync
        device.clone().copy_(host)  # blocking host->device
        device.clone().copy_(host, non_blocking=True)
        host.clone().copy_(device)  # blocking device->host
        host.to(torch.float32)  # a cast stays on the host
        on_host(torch.empty(0, dtype=torch.int64)).to(torch.device("cpu"))  # nothing to copy
    assert rec.by_kind == {"d2h-copy": 1, "h2d-copy": 2}


def test_factories_in_a_block_make_host_tensors_unless_given_a_device():
    with count_syncs(backend="cpu") as rec:
        host_made = [torch.tensor([1, 2]), torch.zeros(2), torch.arange(3), torch.tensor([3], device="cpu")]
        device_made = torch.tensor([1, 2], device=torch.device("cpu"))  # a blocking pageable copy
        empty_on_device = torch.tensor([], device=torch.device("cpu"))  # nothing copied
        for t in host_made:
            t.tolist()
        device_made.tolist()
    assert all(is_host(t) for t in host_made)
    assert not is_host(device_made) and not is_host(empty_on_device)
    assert rec.by_kind == {"h2d-copy": 1, "tolist": 1}


def test_cpu_copy_result_is_a_host_tensor():
    x = torch.tensor([1, 2])
    with count_syncs(backend="cpu") as rec:
        host = x.cpu()
        host.tolist()  # already on the host: no second sync
    assert rec.by_kind == {"d2h-copy": 1}
    assert isinstance(host, HostTensor)


def test_on_host_marks_jagged_tensors_and_rejects_other_types():
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    jt = JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    marked = on_host({"jt": jt, "kjt": [kjt]})
    assert is_host(marked["jt"].values()) and is_host(marked["jt"].lengths())
    assert is_host(marked["kjt"][0].values()) and is_host(marked["kjt"][0].lengths())
    assert not is_host(jt.values())  # the originals are untouched
    with pytest.raises(TypeError, match="on_host takes tensors"):
        on_host(object())


def test_a_wrapped_call_inside_another_is_counted_once():
    # Tensor.unique calls torch.unique; both are wrapped.
    assert _count(lambda x: x.unique(), torch.tensor([3, 1, 3]))[0] == 1


def test_compiled_regions_are_not_counted_by_the_proxy():
    def read(x):
        return torch.nonzero(x)

    compiled = torch.compile(read, backend="eager", dynamic=False)
    x = torch.tensor([0, 1, 1])
    with count_syncs(backend="cpu") as rec:
        compiled(x)
    assert rec.total == 0


def test_legacy_constructors_in_a_block_make_host_tensors_and_keep_their_type_checks():
    # torch.IntTensor(data, device="cpu") is how torchrec makes a VBE KJT's strides: CPU-only, so host.
    with count_syncs(backend="cpu") as rec:
        strides = torch.IntTensor([[2], [4], [3]], device="cpu")
        strides.sum(dim=1).tolist()
        strides.sum(dim=1).max().item()
        assert isinstance(strides, torch.IntTensor) and not isinstance(strides, torch.LongTensor)
        assert torch.IntTensor.dtype == torch.int32
    assert is_host(strides)
    assert rec.total == 0
    # Outside any block the constructor is torch's own again, and its tensor stands for device data.
    assert not is_host(torch.IntTensor([1]))
    assert type(torch.IntTensor).__name__ != "_LegacyConstructorType"


def test_on_host_declares_a_vbe_kjts_strides_host_data():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 0, 2]), stride_per_key_per_rank=[[1], [2]]
    )
    assert not is_host(kjt._stride_per_key_per_rank)  # made outside a block: stands for device data
    assert is_host(on_host(kjt)._stride_per_key_per_rank)
