"""Planted bugs in torchrec's sharded embedding modules, for the sharding check's negative controls.

Each stands for a realistic torchrec defect in a sharded path: column-wise stitching, pooling modes,
the row-wise bucketization, per-id weights, the MEAN divisor, the output's keys, variable batches,
gradient division and the fused optimizer's parameters. The unsharded reference is untouched by
all of them (the planted functions only run in sharded modules), so the check must see them.
"""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "sharding"


@register("cw-permute-rank-order", check=CHECK)
def cw_permute_rank_order() -> ContextManager[None]:
    """Concatenate CW shard outputs in arrival (rank) order, ignoring the per-feature permutation."""
    import torchrec.modules.utils as utils

    return replaced(utils, "_permute_indices", lambda original: lambda indices, permute: list(indices))


@register("cw-permute-inverted", check=CHECK)
def cw_permute_inverted() -> ContextManager[None]:
    """Store the inverse permutation (arrival -> shard instead of shard -> arrival).

    Identical for placements whose permutation is its own inverse ([0, 1, 0]); wrong for 3-cycles
    such as [1, 0, 0].
    """
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    def planted(original):
        def inverted(self, embedding_configs, table_name_to_parameter_sharding):
            original(self, embedding_configs, table_name_to_parameter_sharding)
            for key, permute in self._features_to_permute_indices.items():
                inverse = [0] * len(permute)
                for shard, position in enumerate(permute):
                    inverse[position] = shard
                self._features_to_permute_indices[key] = inverse

        return inverted

    return replaced(ShardedEmbeddingCollection, "_generate_permute_indices_per_feature", planted)


@register("wrong-pooling-mode", check=CHECK)
def wrong_pooling_mode() -> ContextManager[None]:
    """Sharded EBC kernels pool MEAN tables with SUM (the pooling-type -> TBE mode mapping is wrong).

    The unsharded module still averages, so sharded-vs-unsharded parity is what sees it.
    """
    import torchrec.distributed.batched_embedding_kernel as kernel
    from torchrec.modules.embedding_configs import PoolingType

    def planted(original):
        def mean_becomes_sum(pooling_type, *args, **kwargs):
            if pooling_type == PoolingType.MEAN:
                pooling_type = PoolingType.SUM
            return original(pooling_type, *args, **kwargs)

        return mean_becomes_sum

    return replaced(kernel, "pooling_type_to_pooling_mode", planted)


@register("pooled-all-to-all-backward-not-divided", check=CHECK)
def pooled_all_to_all_backward_not_divided() -> ContextManager[None]:
    """The pooled all-to-all's backward (table- and column-wise EBC tables) stops dividing gradients by
    the world size although torchrec's gradient division is on: those tables learn world-size times faster."""
    import torch.distributed as dist
    from torchrec.distributed import comm_ops

    def planted(original):
        def backward(ctx, *unused):
            result = original(ctx, *unused)
            if comm_ops.GRADIENT_DIVISION and result[3] is not None:
                result[3].mul_(dist.get_world_size(ctx.pg))
            return result

        return staticmethod(backward)

    return replaced(comm_ops.All2All_Pooled_Req, "backward", planted)


@register("row-wise-bucketize-block-off-by-one", check=CHECK)
def row_wise_bucketize_block_off_by_one() -> ContextManager[None]:
    """Row-wise input distribution bucketizes ids with blocks one row too large: ids near a shard
    boundary go to the wrong rank and read another row."""
    from torchrec.distributed.sharding import rw_sharding

    def planted(original):
        def bucketize(kjt, num_buckets, block_sizes, *args, **kwargs):
            return original(kjt, num_buckets, block_sizes + 1, *args, **kwargs)

        return bucketize

    return replaced(rw_sharding, "bucketize_kjt_before_all2all", planted)


@register("row-wise-bucketize-loses-weights", check=CHECK)
def row_wise_bucketize_loses_weights() -> ContextManager[None]:
    """Row-wise input distribution sends every per-id weight as 1.0: a weighted row-wise EBC pools unweighted."""
    import torch
    from torchrec.distributed.sharding import rw_sharding
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def bucketize(kjt, *args, **kwargs):
            if kjt.weights_or_none() is not None:
                kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                        weights=torch.ones_like(kjt.weights()),
                                        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None,
                                        stride=None if kjt.variable_stride_per_key() else kjt.stride())
            return original(kjt, *args, **kwargs)

        return bucketize

    return replaced(rw_sharding, "bucketize_kjt_before_all2all", planted)


@register("mean-divisor-epsilon-1e-3", check=CHECK)
def mean_divisor_epsilon_1e_3() -> ContextManager[None]:
    """Row-wise MEAN pooling guards its divisor with 1e-3 instead of 1e-6: a consistent drift of about
    1e-3 / length in every averaged output, the size a tolerance must not hide."""
    from torchrec.distributed import embeddingbag

    def planted(original):
        def divisor(*args, **kwargs):
            return original(*args, **kwargs) + 1e-3

        return divisor

    return replaced(embeddingbag, "_create_mean_pooling_divisor", planted)


@register("sharded-ebc-output-keys-swapped", check=CHECK)
def sharded_ebc_output_keys_swapped() -> ContextManager[None]:
    """A sharded EBC labels its output with its first two embedding names swapped: values stay in
    place, so two features' embeddings carry each other's keys."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    def planted(original):
        def create_output_dist(self):
            original(self)
            names = self._embedding_names
            if len(names) > 1 and self._embedding_dims[0] == self._embedding_dims[1]:
                names[0], names[1] = names[1], names[0]

        return create_output_dist

    return replaced(ShardedEmbeddingBagCollection, "_create_output_dist", planted)


@register("variable-batch-inverse-indices-reversed", check=CHECK)
def variable_batch_inverse_indices_reversed() -> ContextManager[None]:
    """A sharded EBC fed a variable batch expands its outputs with the inverse indices of its features in
    reverse order (the permutation to embedding order built backwards): each output row of one
    feature is taken from the sample another feature's inverse indices name."""
    import torch
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    def planted(original):
        def create(self, inverse_indices):
            original(self, inverse_indices)
            indices = self._inverse_indices_permute_indices
            if indices is None:
                indices = torch.arange(len(inverse_indices[0]), device=inverse_indices[1].device)
            self._inverse_indices_permute_indices = indices.flip(0)

        return create

    return replaced(ShardedEmbeddingBagCollection, "_create_inverse_indices_permute_indices", planted)


@register("fused-optimizer-learning-rate-doubled", check=CHECK)
def fused_optimizer_learning_rate_doubled() -> ContextManager[None]:
    """The EBC sharder hands fbgemm twice the learning rate of a table's in-backward optimizer."""
    from torchrec.distributed import embeddingbag

    def planted(original):
        def merge(fused_params=None, param_fused_params=None):
            merged = original(fused_params, param_fused_params)
            for key in ("learning_rate", "lr"):
                if key in merged:
                    merged[key] = merged[key] * 2
            return merged

        return merge

    return replaced(embeddingbag, "merge_fused_params", planted)


# The DMP and collectives plants live beside their cases; importing them registers them here.
from paritykit.checks.sharding import dmp_plants  # noqa: E402,F401
