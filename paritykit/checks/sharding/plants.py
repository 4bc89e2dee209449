"""Planted bugs in torchrec's column-wise stitching and sharded pooling, caught by the cw-stitch check."""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "cw-stitch"


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
