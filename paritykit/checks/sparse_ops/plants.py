"""Planted bugs that the `sparse-ops` check must catch: each a realistic slip in torchrec's sparse ops.

Each one changes what torchrec computes (tests/test_sparse_ops_plants.py shows it on torchrec alone
first), and a pinned case of the check catches it with the self-test's few examples.
"""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "sparse-ops"


@register("regroup-misorders-second-kt-keys", check=CHECK)
def regroup_misorders_second_kt_keys() -> ContextManager[None]:
    """KeyedTensor.regroup's fast path lists the keys of every KeyedTensor after the first in reverse.

    ``_remap_to_groups`` builds its key -> column map from the flattened keys: with the second EBC's
    keys reversed (but not their lengths), its features are read from each other's columns.
    """
    import torchrec.sparse.jagged_tensor as jagged_tensor

    def planted(original):
        def remap_with_reversed_later_keys(keys, key_lengths, groups):
            return original([keys[0]] + [list(reversed(k)) for k in keys[1:]], key_lengths, groups)

        return remap_with_reversed_later_keys

    return replaced(jagged_tensor, "_remap_to_groups", planted)


@register("to-padded-dense-ignores-desired-length", check=CHECK)
def to_padded_dense_ignores_desired_length() -> ContextManager[None]:
    """JaggedTensor.to_padded_dense pads to the longest row whatever desired_length asks for."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    def planted(original):
        def to_padded_dense(self, desired_length=None, padding_value=0.0):
            return original(self, None, padding_value)

        return to_padded_dense

    return replaced(JaggedTensor, "to_padded_dense", planted)


@register("padded-dense-weights-ignore-padding-value", check=CHECK)
def padded_dense_weights_ignore_padding_value() -> ContextManager[None]:
    """JaggedTensor.to_padded_dense_weights pads the weights with 0.0 whatever padding_value says."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    def planted(original):
        def to_padded_dense_weights(self, desired_length=None, padding_value=0.0):
            return original(self, desired_length, 0.0)

        return to_padded_dense_weights

    return replaced(JaggedTensor, "to_padded_dense_weights", planted)


@register("permute-drops-weights", check=CHECK)
def permute_drops_weights() -> ContextManager[None]:
    """KeyedJaggedTensor.permute returns the permuted ids without their per-id weights."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def permute(self, indices, indices_tensor=None):
            permuted = original(self, indices, indices_tensor)
            permuted._weights = None  # the planted loss
            return permuted

        return permute

    return replaced(KeyedJaggedTensor, "permute", planted)


@register("split-last-key-off-by-one", check=CHECK)
def split_last_key_off_by_one() -> ContextManager[None]:
    """KeyedJaggedTensor.split ends the last piece's values one key early (its last key's ids dropped)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def split(self, segments):
            pieces = original(self, segments)
            last = pieces[-1] if pieces else None
            if last is None or last is self or not last.keys():
                return pieces
            end = sum(last.length_per_key()[:-1])  # offset_per_key[end - 1] instead of [end]
            last._values = last.values()[:end]
            if last.weights_or_none() is not None:
                last._weights = last.weights()[:end]
            return pieces

        return split

    return replaced(KeyedJaggedTensor, "split", planted)


@register("vbe-to-dict-wrong-stride", check=CHECK)
def vbe_to_dict_wrong_stride() -> ContextManager[None]:
    """A variable-batch KJT's to_dict cuts the lengths by the batch size of the next key (strides rotated)."""
    import torchrec.sparse.jagged_tensor as jagged_tensor

    def planted(original):
        def to_jt_dict(stride, stride_per_key, keys, length_per_key, values, lengths, variable_stride_per_key, weights,
                       jt_dict, compute_offsets=True):
            if variable_stride_per_key and len(stride_per_key) > 1:
                stride_per_key = stride_per_key[1:] + stride_per_key[:1]
            return original(stride, stride_per_key, keys, length_per_key, values, lengths, variable_stride_per_key,
                            weights, jt_dict, compute_offsets)

        return to_jt_dict

    return replaced(jagged_tensor, "_maybe_compute_kjt_to_jt_dict", planted)


@register("dist-splits-weights-use-batch-sizes", check=CHECK)
def dist_splits_weights_use_batch_sizes() -> ContextManager[None]:
    """KeyedJaggedTensor.dist_splits sends the weights in the batch-size splits instead of the lengths'."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def dist_splits(self, key_splits):
            splits = original(self, key_splits)
            if self.weights_or_none() is not None:
                splits[-1] = list(splits[0])  # copy-pasted from the lengths' line
            return splits

        return dist_splits

    return replaced(KeyedJaggedTensor, "dist_splits", planted)


@register("regroup-repeated-key-loses-gradient", check=CHECK)
def regroup_repeated_key_loses_gradient() -> ContextManager[None]:
    """KeyedTensor.regroup with a key in two groups detaches its second use: the same numbers, but
    that key's embedding gets the gradient of its first group only."""
    import torch
    import torchrec.sparse.jagged_tensor as jagged_tensor

    def planted(_original):
        def regroup_keyed_tensors(keyed_tensors, groups):
            blocks = {key: t for kt in keyed_tensors for key, t in kt.to_dict().items()}
            seen: set[str] = set()
            out = []
            for group in groups:
                parts = [blocks[key] if key not in seen else blocks[key].detach() for key in group]
                seen.update(group)
                out.append(torch.cat(parts, dim=keyed_tensors[0].key_dim()))
            return out

        return regroup_keyed_tensors

    return replaced(jagged_tensor, "_regroup_keyed_tensors", planted)


@register("kt-regroup-module-ignores-emb-dtype", check=CHECK)
def kt_regroup_module_ignores_emb_dtype() -> ContextManager[None]:
    """KTRegroupAsDict drops its emb_dtype: the regrouped embeddings keep the input dtype."""
    from torchrec.modules.regroup import KTRegroupAsDict

    return replaced(KTRegroupAsDict, "embedding_cast", lambda _original: lambda self, embs: embs)


@register("getitem-reads-offsets", check=CHECK)
def getitem_reads_offsets() -> ContextManager[None]:
    """KeyedJaggedTensor.__getitem__ reads the key's first and last offset from the device offsets
    (``int(offsets[i])``) to slice the values: two syncs per lookup, the same numbers."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def getitem(self, key):
            index = self._key_indices()[key]
            bounds = self.lengths_offset_per_key()
            _start, _end = int(self.offsets()[bounds[index]]), int(self.offsets()[bounds[index + 1]])  # the planted reads
            return original(self, key)

        return getitem

    return replaced(KeyedJaggedTensor, "__getitem__", planted)


@register("kjt-concat-drops-length-per-key", check=CHECK)
def kjt_concat_drops_length_per_key() -> ContextManager[None]:
    """KeyedJaggedTensor.concat forgets the inputs' length_per_key: the same KJT, but the next
    length_per_key() reads the lengths back from the device (one sync per batch in the input dist)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def concat(kjt_list):
            out = original(kjt_list)
            out._length_per_key, out._offset_per_key = None, None  # the dropped length_per_key= argument
            return out

        return staticmethod(concat)

    return replaced(KeyedJaggedTensor, "concat", planted)
@register("validator-skips-first-offset", check=CHECK)
def validator_skips_first_offset() -> ContextManager[None]:
    """validate_keyed_jagged_tensor no longer checks that the offsets start at 0 (the last one still must
    be the number of values): a KJT whose first row starts at id 1 passes."""
    import torch
    import torchrec.sparse.jagged_tensor_validator as validator

    def planted(original):
        def first_offset_unchecked(offsets, values):
            return original(torch.cat([offsets.new_zeros(1), offsets[1:]]) if offsets.numel() else offsets, values)

        return first_offset_unchecked

    return replaced(validator, "_validate_offsets", planted)


@register("offsets-only-length-per-key-empty", check=CHECK)
def offsets_only_length_per_key_empty() -> ContextManager[None]:
    """A KJT given only offsets computes no length_per_key (the offsets branch skipped) until something
    has computed its lengths: asked first, length_per_key() is []."""
    import torchrec.sparse.jagged_tensor as jagged_tensor

    def planted(original):
        def skip_offsets(*args, **kwargs):
            if kwargs.get("lengths") is None and kwargs.get("length_per_key") is None:
                return []
            return original(*args, **kwargs)

        return skip_offsets

    return replaced(jagged_tensor, "_maybe_compute_length_per_key", planted)


@register("ec-drops-need-indices", check=CHECK)
def ec_drops_need_indices() -> ContextManager[None]:
    """An unsharded EmbeddingCollection built with need_indices=True returns its features without their ids."""
    from torchrec.modules.embedding_modules import EmbeddingCollection

    def planted(original):
        def forward(self, features):
            need, self._need_indices = self._need_indices, False
            try:
                return original(self, features)
            finally:
                self._need_indices = need

        return forward

    return replaced(EmbeddingCollection, "forward", planted)


@register("construct-jagged-tensors-ignores-shard-order", check=CHECK)
def construct_jagged_tensors_ignores_shard_order() -> ContextManager[None]:
    """construct_jagged_tensors joins a feature's column shards in the order of the features, ignoring
    features_to_permute_indices (the CW shards' order on the ranks)."""
    import torchrec.modules.utils as utils

    def planted(original):
        def in_feature_order(*args, **kwargs):
            return original(*args, **{**kwargs, "features_to_permute_indices": None})

        return in_feature_order

    return replaced(utils, "construct_jagged_tensors", planted)
