"""The inputs every sync budget shares: one small sparse batch, as host JaggedTensors, a device KJT
(with or without metadata), a TensorDict, and the EBC that reads it."""

from __future__ import annotations

from typing import Any

import torch

from paritykit.sync import on_host

KEYS = ("f0", "f1", "f2")
BATCH = 4
# Lengths per key (batch of 4), key-major as in a KJT's lengths tensor.
LENGTHS = ((2, 0, 1, 3), (1, 1, 0, 2), (0, 3, 1, 1))
NUM_EMBEDDINGS = 16


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


def make_ebc(device: torch.device) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t_{key}", embedding_dim=4, num_embeddings=NUM_EMBEDDINGS, feature_names=[key])
        for key in KEYS
    ]
    return EmbeddingBagCollection(tables=tables, device=device)


def device_td(device: torch.device) -> Any:
    """The same batch as a TensorDict of nested jagged tensors on the device (torchrec's TD input)."""
    from tensordict import TensorDict

    features = {
        key: torch.nested.nested_tensor_from_jagged(
            torch.tensor(values_of(lens, 3 * k), device=device), lengths=torch.tensor(lens, device=device)
        )
        for k, (key, lens) in enumerate(zip(KEYS, LENGTHS))
    }
    return TensorDict(features, batch_size=[BATCH], device=device)


def backend_for(device: str) -> str:
    """The sync backend that counts a region on ``device``: the CUDA backend on "cuda", the CPU proxy on "cpu"."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"the sync check runs on 'cpu' or 'cuda', got {device!r}")
    return device
