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


@register("ec-forward-id-bounds-check", check=CHECK)
def ec_forward_id_bounds_check() -> ContextManager[None]:
    """EmbeddingCollection.forward checks every feature's ids against its table size before the lookup.

    ``if (ids >= num_embeddings).any(): raise`` reads a device bool per feature: the classic sync
    of a well-meant validation left in an eager forward. Numbers are unchanged.
    """
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def forward_with_planted_bounds_check(self, features):
            if isinstance(features, KeyedJaggedTensor):
                jt_dict = features.to_dict()
                for config in self.embedding_configs():
                    for name in config.feature_names:
                        if (jt_dict[name].values() >= config.num_embeddings).any():  # the planted sync
                            raise IndexError(f"feature {name!r} has an id >= {config.num_embeddings}")
            return original(self, features)

        return forward_with_planted_bounds_check

    return replaced(EmbeddingCollection, "forward", planted)


@register("ec-output-dist-drops-length-metadata", check=CHECK)
def ec_output_dist_drops_length_metadata() -> ContextManager[None]:
    """A sharded EC rebuilds the features it splits its output by, dropping their length_per_key.

    ``construct_jagged_tensors`` (called by EmbeddingCollectionAwaitable) gets a KJT rebuilt from
    keys, values and lengths, so its ``features.length_per_key()`` reads the lengths back from the
    device: one more sync per sharding type in every sharded EC forward. input_dist is untouched.
    """
    import torchrec.distributed.embedding as sharded_embedding
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def construct_jagged_tensors_from_rebuilt_features(*args, **kwargs):
            features = kwargs["features"]
            kwargs["features"] = KeyedJaggedTensor(  # the planted loss of metadata
                keys=features.keys(), values=features.values(), lengths=features.lengths(), weights=features.weights_or_none()
            )
            return original(*args, **kwargs)

        return construct_jagged_tensors_from_rebuilt_features

    return replaced(sharded_embedding, "construct_jagged_tensors", planted)


@register("vbe-length-per-key-read-per-key", check=CHECK)
def vbe_length_per_key_read_per_key() -> ContextManager[None]:
    """A VBE KJT's length_per_key reads each key's total separately instead of in one transfer.

    ``_length_per_key_from_stride_per_key`` sums each key's slice of the lengths and converts it
    with ``int(...)``: one device read per key where torchrec makes one for all keys. Same numbers.
    """
    import torch
    import torchrec.sparse.jagged_tensor as jagged_tensor

    def planted(_original):
        def length_per_key_one_read_per_key(lengths, stride_per_key):
            per_key = []
            for chunk in torch.split(lengths, stride_per_key):
                per_key.append(int(torch.sum(chunk)))  # the planted sync, once per key
            return per_key

        return length_per_key_one_read_per_key

    return replaced(jagged_tensor, "_length_per_key_from_stride_per_key", planted)


@register("pin-and-move-blocks", check=CHECK)
def pin_and_move_blocks() -> ContextManager[None]:
    """torchrec's ``_pin_and_move`` copies its host tensors to the device with a blocking copy.

    KeyedTensor.regroup moves its four permute/offset tensors with it, and a VBE KJT's permute and
    length_per_key move their length and stride tensors with it: each move becomes a pageable
    blocking host->device copy instead of a pinned asynchronous one. Same numbers.
    """
    import torchrec.sparse.jagged_tensor as jagged_tensor

    def planted(_original):
        def move_blocking(tensor, device):
            return tensor.to(device=device)  # the planted blocking copy

        return move_blocking

    return replaced(jagged_tensor, "_pin_and_move", planted)
