"""Budgets of an EmbeddingCollection's eager forward and of the TD paths into it.

EmbeddingCollection.forward (torchrec/modules/embedding_modules.py) does, per call:
``maybe_td_to_kjt(features)`` (a KJT passes through), ``features.to_dict()``, then per feature an
``nn.Embedding`` lookup of the feature's values and a JaggedTensor of the lookup with the feature's
lengths (and its values as weights when ``need_indices``). The only host read is ``to_dict`` ->
``length_per_key`` -> ``_maybe_compute_length_per_key``: one ``_safe_tolist`` of the summed device
lengths, unless the KJT carries length_per_key already. ``need_indices`` reuses tensors the
forward has anyway, so it changes no count. The TD paths into it are those of
paritykit.checks.sync.td_paths.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paritykit.checks.sync.budget import SyncBudget
from paritykit.checks.sync.inputs import device_kjt, host_jts, make_ec
from paritykit.checks.sync.td_paths import paritykit_td_path, torchrec_td_path

LENGTH_PER_KEY = "_maybe_compute_length_per_key"


def _forward_moved_kjt(need_indices: bool) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        # from_jt_dict computes length_per_key on the host; KJT.to carries it: to_dict reads nothing.
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        ec = make_ec(device, need_indices)
        kjt = KeyedJaggedTensor.from_jt_dict(host_jts()).to(device, non_blocking=True)
        return lambda: ec(kjt)

    return prepare


def _forward_kjt_without_metadata(need_indices: bool) -> Callable[[torch.device], Callable[[], Any]]:
    def prepare(device: torch.device) -> Callable[[], Any]:
        # to_dict -> length_per_key -> _maybe_compute_length_per_key reads the device lengths: 1.
        ec = make_ec(device, need_indices)
        kjt = device_kjt(device, synced=False)
        return lambda: ec(kjt)

    return prepare


EC_BUDGETS: tuple[SyncBudget, ...] = (
    SyncBudget("ec_forward.kjt_from_host_jts_moved", 0, _forward_moved_kjt(need_indices=False)),
    SyncBudget("ec_forward.kjt_from_host_jts_moved.need_indices", 0, _forward_moved_kjt(need_indices=True)),
    SyncBudget("ec_forward.kjt_without_metadata", 1, _forward_kjt_without_metadata(need_indices=False), (LENGTH_PER_KEY,)),
    SyncBudget(
        "ec_forward.kjt_without_metadata.need_indices", 1, _forward_kjt_without_metadata(need_indices=True), (LENGTH_PER_KEY,)
    ),
    SyncBudget(
        "ec_td_path.torchrec_maybe_td_to_kjt",
        1,
        torchrec_td_path(make_ec, "EmbeddingCollection.forward"),
        (LENGTH_PER_KEY,),
    ),
    SyncBudget("ec_td_path.paritykit_td_to_kjt", 0, paritykit_td_path(make_ec)),
)
