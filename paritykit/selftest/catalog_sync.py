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
