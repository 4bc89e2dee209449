"""Planted bugs that the `sync` check must catch."""

from __future__ import annotations

import contextlib
from typing import Iterator

from paritykit import plants


@plants.register("tolist-in-ebc-forward")
@contextlib.contextmanager
def tolist_in_ebc_forward() -> Iterator[None]:
    """EmbeddingBagCollection.forward reads the lengths back to the host before pooling.

    A classic regression: a debugging or validation ``.tolist()`` left in a forward path, one
    device->host sync per batch that no numeric check sees.
    """
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    original = EmbeddingBagCollection.__dict__["forward"]

    def forward_with_planted_tolist(self, features):
        if hasattr(features, "lengths"):
            _batch_lengths = features.lengths().tolist()  # the planted sync
        return original(self, features)

    EmbeddingBagCollection.forward = forward_with_planted_tolist
    try:
        yield
    finally:
        EmbeddingBagCollection.forward = original


@plants.register("kjt-to-drops-non-blocking")
@contextlib.contextmanager
def kjt_to_drops_non_blocking() -> Iterator[None]:
    """KeyedJaggedTensor.to ignores non_blocking=True: every host->device move of a batch blocks.

    Numbers are unchanged; only the sync budget of the "build on host, move asynchronously" path sees it.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    original = KeyedJaggedTensor.__dict__["to"]

    def to_blocking(self, device, non_blocking=False, dtype=None):
        return original(self, device, non_blocking=False, dtype=dtype)

    KeyedJaggedTensor.to = to_blocking
    try:
        yield
    finally:
        KeyedJaggedTensor.to = original
