"""Planted bugs for the plan-helper, weight-init, quantized-communication and variable-batch
comparisons (plan_helper_cases.py, init_bounds.py, codec_oracle.py, case_runner's dense equivalent):
each a realistic torchrec defect that the sharded-against-unsharded comparison alone would not see.
"""

from __future__ import annotations

import contextlib
import functools
from typing import ContextManager, Iterator

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "sharding"


@register("row-wise-plan-balanced-blocks", check=CHECK)
def row_wise_plan_balanced_blocks() -> ContextManager[None]:
    """torchrec's row-wise shard sizes balanced (10 rows on 4 ranks as 3, 3, 2, 2) where its row-wise
    sharding buckets ids by blocks of ceil(rows / ranks) (3, 3, 3, 1)."""
    import torchrec.distributed.sharding_plan as sp

    def planted(original):
        def balanced(hash_size, num_devices, columns, num_buckets=None):
            if num_buckets:
                return original(hash_size, num_devices, columns, num_buckets)
            base, extra = divmod(hash_size, num_devices)
            sizes = [[base + (1 if rank < extra else 0), columns] for rank in range(num_devices)]
            offsets = [[sum(s[0] for s in sizes[:rank]), 0] for rank in range(num_devices)]
            return sizes, offsets

        return balanced

    return replaced(sp, "_calculate_rw_shard_sizes_and_offsets", planted)


@register("column-wise-plan-ranks-sorted", check=CHECK)
def column_wise_plan_ranks_sorted() -> ContextManager[None]:
    """column_wise(ranks=[1, 0]) places its shards on the ranks in sorted order (shard 0 on rank 0)."""
    import torchrec.distributed.sharding_plan as sp

    def planted(original):
        @functools.wraps(original)  # torchrec's signature kept: paritykit reads it for size_per_rank
        def column_wise(ranks=None, *args, **kwargs):
            return original(sorted(ranks) if ranks is not None else None, *args, **kwargs)

        return column_wise

    return replaced(sp, "column_wise", planted)


@register("sharded-table-weight-init-bounds-dropped", check=CHECK)
def sharded_table_weight_init_bounds_dropped() -> ContextManager[None]:
    """A sharded EBC/EC (re)initialises its shards in torchrec's default range, uniform in
    +-sqrt(1 / rows), instead of its tables' configured weight_init_min/max (their init_fn)."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    def planted(configs_of):
        def make(original):
            def reset_parameters(self):
                import functools

                import torch

                configs = configs_of(self)
                saved = [config.init_fn for config in configs]
                try:
                    for config in configs:
                        bound = (1 / config.num_embeddings) ** 0.5
                        config.init_fn = functools.partial(torch.nn.init.uniform_, a=-bound, b=bound)
                    original(self)
                finally:
                    for config, init_fn in zip(configs, saved):
                        config.init_fn = init_fn

            return reset_parameters

        return make

    return _both(replaced(ShardedEmbeddingBagCollection, "reset_parameters", planted(lambda m: m._embedding_bag_configs)),
                 replaced(ShardedEmbeddingCollection, "reset_parameters", planted(lambda m: m._embedding_configs)))


@register("row-wise-sequence-output-dist-drops-codecs", check=CHECK)
def row_wise_sequence_output_dist_drops_codecs() -> ContextManager[None]:
    """A row-wise sharded EC's output all-to-all built without the quantized-communication codecs:
    the user asked for FP16 on the wire and gets float32 (numbers closer to the unsharded module's)."""
    from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding

    def planted(original):
        def create_output_dist(self, device=None):
            registry, self._qcomm_codecs_registry = self._qcomm_codecs_registry, None
            try:
                return original(self, device)
            finally:
                self._qcomm_codecs_registry = registry

        return create_output_dist

    return replaced(RwSequenceEmbeddingSharding, "create_output_dist", planted)


@register("kjt-inverse-indices-rows-reversed", check=CHECK)
def kjt_inverse_indices_rows_reversed() -> ContextManager[None]:
    """A KeyedJaggedTensor hands out its inverse indices with the output rows reversed: the sharded and
    the unsharded EBC both read them, so they agree with each other and both expand a variable batch
    wrongly (only an oracle that never sees inverse indices can tell)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def inverse_indices_or_none(self):
            found = original(self)
            return None if found is None else (found[0], found[1].flip(1))

        return inverse_indices_or_none

    return replaced(KeyedJaggedTensor, "inverse_indices_or_none", planted)


@contextlib.contextmanager
def _both(first: ContextManager, second: ContextManager) -> Iterator[None]:
    with first, second:
        yield
