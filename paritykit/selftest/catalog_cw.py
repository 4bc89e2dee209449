"""Planted bugs in torchrec's column-wise stitching, caught by the cw-stitch check."""

from __future__ import annotations

import contextlib
from typing import Iterator

from paritykit import plants


@plants.register("cw-permute-rank-order")
@contextlib.contextmanager
def cw_permute_rank_order() -> Iterator[None]:
    """Concatenate CW shard outputs in arrival (rank) order, ignoring the per-feature permutation."""
    import torchrec.modules.utils as utils

    original = utils._permute_indices
    utils._permute_indices = lambda indices, permute: list(indices)
    try:
        yield
    finally:
        utils._permute_indices = original


@plants.register("cw-permute-inverted")
@contextlib.contextmanager
def cw_permute_inverted() -> Iterator[None]:
    """Store the inverse permutation (arrival -> shard instead of shard -> arrival).

    Identical for placements whose permutation is its own inverse ([0, 1, 0]); wrong for 3-cycles
    such as [1, 0, 0].
    """
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    original = ShardedEmbeddingCollection._generate_permute_indices_per_feature

    def inverted(self, embedding_configs, table_name_to_parameter_sharding):
        original(self, embedding_configs, table_name_to_parameter_sharding)
        for key, permute in self._features_to_permute_indices.items():
            inverse = [0] * len(permute)
            for shard, position in enumerate(permute):
                inverse[position] = shard
            self._features_to_permute_indices[key] = inverse

    ShardedEmbeddingCollection._generate_permute_indices_per_feature = inverted
    try:
        yield
    finally:
        ShardedEmbeddingCollection._generate_permute_indices_per_feature = original


@plants.register("wrong-pooling-mode")
@contextlib.contextmanager
def wrong_pooling_mode() -> Iterator[None]:
    """Sharded EBC kernels pool MEAN tables with SUM (the pooling-type -> TBE mode mapping is wrong).

    The unsharded module still averages, so sharded-vs-unsharded parity is what sees it.
    """
    import torchrec.distributed.batched_embedding_kernel as kernel
    from torchrec.modules.embedding_configs import PoolingType

    original = kernel.pooling_type_to_pooling_mode

    def mean_becomes_sum(pooling_type, *args, **kwargs):
        if pooling_type == PoolingType.MEAN:
            pooling_type = PoolingType.SUM
        return original(pooling_type, *args, **kwargs)

    kernel.pooling_type_to_pooling_mode = mean_becomes_sum
    try:
        yield
    finally:
        kernel.pooling_type_to_pooling_mode = original
