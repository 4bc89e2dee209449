"""Planted bugs that the `sync` check must catch."""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "sync"


@register("tolist-in-ebc-forward", check=CHECK)
def tolist_in_ebc_forward() -> ContextManager[None]:
    """EmbeddingBagCollection.forward reads the lengths back to the host before pooling.

    A classic regression: a debugging or validation ``.tolist()`` left in a forward path, one
    device->host sync per batch that no numeric check sees.
    """
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    def planted(original):
        def forward_with_planted_tolist(self, features):
            if hasattr(features, "lengths"):
                _batch_lengths = features.lengths().tolist()  # the planted sync
            return original(self, features)

        return forward_with_planted_tolist

    return replaced(EmbeddingBagCollection, "forward", planted)


@register("kjt-to-drops-non-blocking", check=CHECK)
def kjt_to_drops_non_blocking() -> ContextManager[None]:
    """KeyedJaggedTensor.to ignores non_blocking=True: every host->device move of a batch blocks.

    Numbers are unchanged; only the sync budget of the "build on host, move asynchronously" path sees it.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def to_blocking(self, device, non_blocking=False, dtype=None):
            return original(self, device, non_blocking=False, dtype=dtype)

        return to_blocking

    return replaced(KeyedJaggedTensor, "to", planted)


@register("tolist-in-kjt-dist-splits", check=CHECK)
def tolist_in_kjt_dist_splits() -> ContextManager[None]:
    """KeyedJaggedTensor.dist_splits reads the lengths back to the host before the KJT all-to-all.

    A validation read added to the input-distribution path: every sharded module's input_dist,
    eager (KJTAllToAll.forward) or pipelined (runtime_forwards.KJTAllToAllForward), calls
    dist_splits once per batch, so each rank pays one more sync per module per step.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def dist_splits_with_planted_tolist(self, key_splits):
            _lengths = self.lengths().tolist()  # the planted sync
            return original(self, key_splits)

        return dist_splits_with_planted_tolist

    return replaced(KeyedJaggedTensor, "dist_splits", planted)
