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
