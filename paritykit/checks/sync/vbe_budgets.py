"""Budgets of KJT ops on a variable-batch (VBE) KJT: one batch size per key (stride_per_key_per_rank).

torchrec keeps ``stride_per_key_per_rank`` on the host (the KJT constructor makes it with
``device="cpu"``; ``dist_init`` copies it to the host), so ``stride()``
(``_maybe_compute_stride_kjt``: ``.sum(dim=1).max().item()``) and ``stride_per_key()``
(``_maybe_compute_stride_per_key``: ``.sum(dim=1).tolist()``) read host data and never sync. The
device reads, in torchrec/sparse/jagged_tensor.py:

* ``length_per_key`` of a VBE KJT without metadata -> ``_length_per_key_from_stride_per_key``:
  ``_safe_tolist`` of the per-key sums of the device lengths (``fbgemm.segment_sum_csr`` over
  stride offsets moved with ``_pin_and_move``, non-blocking): 1. ``split`` and ``to_dict`` need
  length_per_key, so they pay it; with metadata they read nothing.
* ``permute`` makes ``indices_tensor = torch.tensor(indices, device=self.device())``, a blocking
  host->device copy (1), moves its length and stride tensors with ``_pin_and_move`` (no sync),
  then permutes lengths and values with ``_permute_tensor_by_segments``. On CUDA that is
  ``fbgemm.keyed_jagged_index_select_dim1`` with no ``selected_lengths_sum``, which reads the
  output size from the device inside C++ (``output_offsets[-1].item()``), once for the lengths and
  once for the values: 2 kernel syncs that the CUDA backend counts and the CPU proxy cannot see
  (on CPU torchrec takes ``permute_1D_sparse_data``, where there is nothing to sync). torchrec has
  the values' size on the host (the sum of the permuted length_per_key) but does not pass it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paritykit.checks.sync.budget import SyncBudget
from paritykit.errors import ParityError
from paritykit.sync import on_host

VBE_KEYS = ("f0", "f1", "f2")
# One batch size per key (one rank), and each key's lengths for that many samples.
VBE_STRIDES = (2, 4, 3)
VBE_LENGTHS = ((2, 0), (1, 1, 0, 2), (0, 3, 1))
VBE_PERMUTE = [2, 0, 1]

LENGTH_PER_KEY = "_length_per_key_from_stride_per_key"
PERMUTE = "permute"
PERMUTE_KERNELS = {"_permute_tensor_by_segments": 2}


def vbe_device_kjt(device: torch.device, synced: bool) -> Any:
    """A VBE KJT with values and lengths made on the device; its strides are host data, as torchrec keeps them."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [n for lens in VBE_LENGTHS for n in lens]
    strides = on_host(torch.tensor([[s] for s in VBE_STRIDES], dtype=torch.int32))
    kjt = KeyedJaggedTensor(
        keys=list(VBE_KEYS),
        values=torch.tensor(list(range(sum(lengths))), device=device),
        lengths=torch.tensor(lengths, device=device),
        stride_per_key_per_rank=strides,
    )
    if not kjt.variable_stride_per_key():
        raise ParityError(
            f"KeyedJaggedTensor given stride_per_key_per_rank={[[s] for s in VBE_STRIDES]} is not variable-batch "
            "(variable_stride_per_key() is False): the VBE budgets would count a fixed-batch KJT"
        )
    return kjt.sync() if synced else kjt


def vbe_host_jts() -> dict[str, Any]:
    """The same batch as host JaggedTensors, one batch size per key."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    jts, start = {}, 0
    for key, lens in zip(VBE_KEYS, VBE_LENGTHS):
        jts[key] = JaggedTensor(values=torch.arange(start, start + sum(lens)), lengths=torch.tensor(lens))
        start += sum(lens)
    return on_host(jts)


def _op(op: Callable[[Any], Any], synced: bool) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        kjt = vbe_device_kjt(device, synced)
        return lambda: op(kjt)

    return prepare


def _build_move_to_dict(device: torch.device) -> Callable[[], Any]:
    # from_jt_dict of host JTs with different batch sizes: the strides tensor and length_per_key
    # are computed on the host; KJT.to(non_blocking=True) keeps both: to_dict reads nothing.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    jts = vbe_host_jts()
    return lambda: KeyedJaggedTensor.from_jt_dict(jts).to(device, non_blocking=True).to_dict()


def _permute(kjt: Any) -> Any:
    return kjt.permute(VBE_PERMUTE)


def _split(kjt: Any) -> Any:
    return kjt.split([1, 2])


def _to_dict(kjt: Any) -> Any:
    return kjt.to_dict()


VBE_BUDGETS: tuple[SyncBudget, ...] = (
    SyncBudget("vbe_kjt.permute.with_metadata", 1, _op(_permute, synced=True), (PERMUTE,), PERMUTE_KERNELS),
    SyncBudget(
        "vbe_kjt.permute.without_metadata", 2, _op(_permute, synced=False), (PERMUTE, LENGTH_PER_KEY), PERMUTE_KERNELS
    ),
    SyncBudget("vbe_kjt.split.with_metadata", 0, _op(_split, synced=True)),
    SyncBudget("vbe_kjt.split.without_metadata", 1, _op(_split, synced=False), (LENGTH_PER_KEY,)),
    SyncBudget("vbe_kjt.to_dict.with_metadata", 0, _op(_to_dict, synced=True)),
    SyncBudget("vbe_kjt.to_dict.without_metadata", 1, _op(_to_dict, synced=False), (LENGTH_PER_KEY,)),
    SyncBudget("vbe_kjt.build_from_host_jts_move_to_dict", 0, _build_move_to_dict),
)
