"""Budgets of KeyedJaggedTensor ops, an EmbeddingBagCollection forward and the TD paths into it.

Each says which torchrec call is the sync; see paritykit.checks.sync.budget for how a region is
counted and paritykit.checks.sync.td_paths for the TD paths.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paritykit.checks.sync.budget import SyncBudget
from paritykit.checks.sync.inputs import KEYS, device_kjt, host_jts, make_ebc
from paritykit.checks.sync.td_paths import paritykit_td_path, torchrec_td_path


def _ebc_forward_moved_kjt(device: torch.device) -> Callable[[], Any]:
    # from_jt_dict computes length_per_key/offset_per_key on the host (its tolist reads host data)
    # and KJT.to carries them over, so EBC.forward -> to_dict -> length_per_key reads nothing.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ebc = make_ebc(device)
    kjt = KeyedJaggedTensor.from_jt_dict(host_jts()).to(device)
    return lambda: ebc(kjt)


def _build_and_forward_nonblocking(device: torch.device) -> Callable[[], Any]:
    # The whole of TorchRec's advice inside the region: build from host JTs (host reads only),
    # move with non_blocking=True (cudaMemcpyAsync, no memcpy_and_sync), forward with metadata.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ebc = make_ebc(device)
    jts = host_jts()
    return lambda: ebc(KeyedJaggedTensor.from_jt_dict(jts).to(device, non_blocking=True))


def _move_blocking(device: torch.device) -> Callable[[], Any]:
    # KJT.to without non_blocking: values.to(device) and lengths.to(device) are each a blocking
    # pageable copy (memcpy_and_sync); weights and offsets are None, so 2.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_jt_dict(host_jts())
    return lambda: kjt.to(device)


def _ebc_forward_unsynced_kjt(device: torch.device) -> Callable[[], Any]:
    # EBC.forward -> KJT.to_dict -> length_per_key -> _maybe_compute_length_per_key:
    # _safe_tolist(torch.sum(lengths.view(len(keys), stride), dim=1)) reads the device lengths: 1.
    ebc = make_ebc(device)
    kjt = device_kjt(device, synced=False)
    return lambda: ebc(kjt)


def _from_lengths_sync(device: torch.device) -> Callable[[], Any]:
    # from_lengths_sync -> KJT.sync() -> length_per_key (the one tolist); offset_per_key is then
    # _cumsum of that Python list, no read: 1.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = device_kjt(device, synced=False)
    values, lengths = kjt.values(), kjt.lengths()
    return lambda: KeyedJaggedTensor.from_lengths_sync(keys=list(KEYS), values=values, lengths=lengths)


def _plain_constructor(device: torch.device) -> Callable[[], Any]:
    # The constructor only stores tensors (metadata deferred): 0 at construction.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = device_kjt(device, synced=False)
    values, lengths = kjt.values(), kjt.lengths()
    return lambda: KeyedJaggedTensor(keys=list(KEYS), values=values, lengths=lengths)


def _length_per_key_unsynced(device: torch.device) -> Callable[[], Any]:
    # length_per_key -> _maybe_compute_length_per_key -> _safe_tolist: 1.
    kjt = device_kjt(device, synced=False)
    return lambda: kjt.length_per_key()


def _length_per_key_synced(device: torch.device) -> Callable[[], Any]:
    kjt = device_kjt(device, synced=True)
    return lambda: kjt.length_per_key()


def _permute_synced(device: torch.device) -> Callable[[], Any]:
    # KJT.permute builds indices_tensor = torch.tensor(indices, device=self.device()): a blocking
    # host->device copy of a Python list (1). permute_2D_sparse_data gets permuted_lengths_sum
    # from the metadata, so fbgemm does not read the lengths.
    kjt = device_kjt(device, synced=True)
    return lambda: kjt.permute([2, 0, 1])


def _permute_with_indices_tensor(device: torch.device) -> Callable[[], Any]:
    # The same with the indices tensor made beforehand on the device: 0.
    kjt = device_kjt(device, synced=True)
    indices_tensor = torch.tensor([2, 0, 1], dtype=torch.int, device=device)
    return lambda: kjt.permute([2, 0, 1], indices_tensor)


def _split_synced(device: torch.device) -> Callable[[], Any]:
    # split slices values/lengths with length_per_key/offset_per_key, already known: 0.
    kjt = device_kjt(device, synced=True)
    return lambda: kjt.split([1, 2])


def _split_unsynced(device: torch.device) -> Callable[[], Any]:
    # split -> length_per_key (1 tolist) then offset_per_key (_cumsum of the list): 1.
    kjt = device_kjt(device, synced=False)
    return lambda: kjt.split([1, 2])


def _to_dict_synced(device: torch.device) -> Callable[[], Any]:
    # _maybe_compute_kjt_to_jt_dict splits with length_per_key and views the lengths: 0.
    kjt = device_kjt(device, synced=True)
    return lambda: kjt.to_dict()


def _to_dict_unsynced(device: torch.device) -> Callable[[], Any]:
    # to_dict -> length_per_key: 1.
    kjt = device_kjt(device, synced=False)
    return lambda: kjt.to_dict()


KJT_BUDGETS: tuple[SyncBudget, ...] = (
    SyncBudget("ebc_forward.kjt_from_host_jts_moved", 0, _ebc_forward_moved_kjt),
    SyncBudget("ebc_forward.build_move_nonblocking_forward", 0, _build_and_forward_nonblocking),
    SyncBudget("kjt.to_device_blocking", 2, _move_blocking, ("to",)),
    SyncBudget("ebc_forward.kjt_without_metadata", 1, _ebc_forward_unsynced_kjt, ("_maybe_compute_length_per_key",)),
    SyncBudget("kjt.from_lengths_sync", 1, _from_lengths_sync, ("_maybe_compute_length_per_key",)),
    SyncBudget("kjt.plain_constructor", 0, _plain_constructor),
    SyncBudget("kjt.length_per_key.without_metadata", 1, _length_per_key_unsynced, ("_maybe_compute_length_per_key",)),
    SyncBudget("kjt.length_per_key.with_metadata", 0, _length_per_key_synced),
    SyncBudget("kjt.permute", 1, _permute_synced, ("permute",)),
    SyncBudget("kjt.permute.indices_tensor_given", 0, _permute_with_indices_tensor),
    SyncBudget("kjt.split.with_metadata", 0, _split_synced),
    SyncBudget("kjt.split.without_metadata", 1, _split_unsynced, ("_maybe_compute_length_per_key",)),
    SyncBudget("kjt.to_dict.with_metadata", 0, _to_dict_synced),
    SyncBudget("kjt.to_dict.without_metadata", 1, _to_dict_unsynced, ("_maybe_compute_length_per_key",)),
    SyncBudget(
        "td_path.torchrec_maybe_td_to_kjt",
        1,
        torchrec_td_path(make_ebc, "EmbeddingBagCollection.forward"),
        ("_maybe_compute_length_per_key",),
    ),
    SyncBudget("td_path.paritykit_td_to_kjt", 0, paritykit_td_path(make_ebc)),
)

