"""The inputs the sync budgets share: one small sparse batch, as host JaggedTensors, a device KJT
(with or without metadata), a TensorDict, the EBC and EC that read it, and each rank's version of
the batch for the rank-pool budgets."""

from __future__ import annotations

from typing import Any

import torch

from paritykit.harness.tables import TableSpec
from paritykit.sync import on_host

KEYS = ("f0", "f1", "f2")
BATCH = 4
# Lengths per key (batch of 4), key-major as in a KJT's lengths tensor.
LENGTHS = ((2, 0, 1, 3), (1, 1, 0, 2), (0, 3, 1, 1))
NUM_EMBEDDINGS = 16
# The tables the sharded modules of the rank-pool budgets are built from: t0 serves f0, t1 serves
# f1 and f2 (one dimension, as an EmbeddingCollection needs).
INPUT_DIST_TABLES = (TableSpec("t0", NUM_EMBEDDINGS, 4, ("f0",)), TableSpec("t1", NUM_EMBEDDINGS, 4, ("f1", "f2")))


def values_of(lengths: tuple[int, ...], offset: int) -> list[int]:
    return [(offset + i) % NUM_EMBEDDINGS for i in range(sum(lengths))]


def host_jts() -> dict[str, Any]:
    """One JaggedTensor per key, built on the host and declared so."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    jts = {
        key: JaggedTensor(values=torch.tensor(values_of(lens, 3 * k)), lengths=torch.tensor(lens))
        for k, (key, lens) in enumerate(zip(KEYS, LENGTHS))
    }
    return on_host(jts)


def device_kjt(device: torch.device, synced: bool) -> Any:
    """A KJT whose tensors were made on the device; without metadata unless ``synced``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [n for lens in LENGTHS for n in lens]
    values = [v for k, lens in enumerate(LENGTHS) for v in values_of(lens, 3 * k)]
    kjt = KeyedJaggedTensor(
        keys=list(KEYS),
        values=torch.tensor(values, device=device),
        lengths=torch.tensor(lengths, device=device),
    )
    if synced:
        kjt.sync()
    return kjt


def make_ec(device: torch.device, need_indices: bool = False) -> Any:
    """The EmbeddingCollection of the batch: one table per key (EC tables share one dimension)."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(name=f"t_{key}", embedding_dim=4, num_embeddings=NUM_EMBEDDINGS, feature_names=[key])
        for key in KEYS
    ]
    return EmbeddingCollection(tables=tables, device=device, need_indices=need_indices)


def make_ebc(device: torch.device) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t_{key}", embedding_dim=4, num_embeddings=NUM_EMBEDDINGS, feature_names=[key])
        for key in KEYS
    ]
    return EmbeddingBagCollection(tables=tables, device=device)


def device_td(device: torch.device, values: dict[str, list[int]] | None = None) -> Any:
    """The same batch as a TensorDict of nested jagged tensors on the device (torchrec's TD input).

    ``values`` replaces each key's ids (same lengths), as the rank-pool budgets do per rank and step.
    """
    from tensordict import TensorDict

    values = values or {key: values_of(lens, 3 * k) for k, (key, lens) in enumerate(zip(KEYS, LENGTHS))}
    features = {
        key: torch.nested.nested_tensor_from_jagged(
            torch.tensor(values[key], device=device), lengths=torch.tensor(lens, device=device)
        )
        for key, lens in zip(KEYS, LENGTHS)
    }
    return TensorDict(features, batch_size=[BATCH], device=device)


def rank_values(rank: int, step: int) -> dict[str, list[int]]:
    """Each key's ids for ``rank`` at ``step``: the batch's lengths, ids that differ per rank and step."""
    return {
        key: [(7 * rank + 3 * k + step + i) % NUM_EMBEDDINGS for i in range(sum(lens))]
        for k, (key, lens) in enumerate(zip(KEYS, LENGTHS))
    }


def rank_kjt(rank: int, device: torch.device, with_metadata: bool, step: int) -> Any:
    """This rank's batch: from host JaggedTensors and moved (metadata computed on the host), or
    made on the device from flat lengths (no metadata)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    values = rank_values(rank, step)
    if with_metadata:
        jts = {key: JaggedTensor(values=torch.tensor(values[key]), lengths=torch.tensor(lens)) for key, lens in zip(KEYS, LENGTHS)}
        return KeyedJaggedTensor.from_jt_dict(on_host(jts)).to(device, non_blocking=True)
    return KeyedJaggedTensor(
        keys=list(KEYS),
        values=torch.tensor([v for key in KEYS for v in values[key]], device=device),
        lengths=torch.tensor([n for lens in LENGTHS for n in lens], device=device),
    )


def backend_for(device: str) -> str:
    """The sync backend that counts a region on ``device``: the CUDA backend on "cuda", the CPU proxy on "cpu"."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"the sync check runs on 'cpu' or 'cuda', got {device!r}")
    return device
