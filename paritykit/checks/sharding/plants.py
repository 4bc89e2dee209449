"""Planted bugs in torchrec's sharded embedding modules, for the sharding check's negative controls.

Each stands for a realistic torchrec defect in a sharded path: column-wise stitching, pooling modes,
the row-wise bucketization, per-id weights, the MEAN divisor, the output's keys, variable batches,
gradient division, and the fused optimizer: its hyper-parameters on their way to fbgemm, its type, the
names of its state. The unsharded reference is untouched by
all of them (the planted functions only run in sharded modules), so the check must see them.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator

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


@contextlib.contextmanager
def _merged_fused_params(change) -> Iterator[None]:
    """torchrec's sharders (EBC and EC) merge a table's in-backward optimizer keywords into the fused
    params handed to fbgemm; ``change(merged)`` edits the merged dict in both."""
    from torchrec.distributed import embedding, embeddingbag

    def planted(original):
        def merge(fused_params=None, param_fused_params=None):
            merged = original(fused_params, param_fused_params)
            change(merged)
            return merged

        return merge

    with replaced(embeddingbag, "merge_fused_params", planted), replaced(embedding, "merge_fused_params", planted):
        yield


@register("fused-optimizer-eps-dropped", check=CHECK)
def fused_optimizer_eps_dropped() -> ContextManager[None]:
    """The sharders drop a fused optimizer's eps on its way to fbgemm, which then uses its default 1e-8."""
    return _merged_fused_params(lambda merged: merged.pop("eps", None))


@register("fused-optimizer-weight-decay-dropped", check=CHECK)
def fused_optimizer_weight_decay_dropped() -> ContextManager[None]:
    """The sharders drop a fused optimizer's weight_decay on its way to fbgemm (which then decays by 0)."""
    return _merged_fused_params(lambda merged: merged.pop("weight_decay", None))


@register("fused-optimizer-weight-decay-modes-swapped", check=CHECK)
def fused_optimizer_weight_decay_modes_swapped() -> ContextManager[None]:
    """The sharders swap the weight-decay modes L2 and decoupled on their way to fbgemm.

    At the top level and inside the counter-based regularization definition."""
    import dataclasses

    from fbgemm_gpu.tbe.config.optimizer_config import CounterWeightDecayMode, WeightDecayMode

    swap = {WeightDecayMode.L2: WeightDecayMode.DECOUPLE, WeightDecayMode.DECOUPLE: WeightDecayMode.L2,
            CounterWeightDecayMode.L2: CounterWeightDecayMode.DECOUPLE, CounterWeightDecayMode.DECOUPLE: CounterWeightDecayMode.L2}

    def change(merged):
        if "weight_decay_mode" in merged:
            merged["weight_decay_mode"] = swap.get(merged["weight_decay_mode"], merged["weight_decay_mode"])
        counter = merged.get("counter_based_regularization")
        if counter is not None:
            mode = counter.counter_weight_decay_mode
            merged["counter_based_regularization"] = dataclasses.replace(counter, counter_weight_decay_mode=swap.get(mode, mode))

    return _merged_fused_params(change)


@register("fused-optimizer-ema-mode-dropped", check=CHECK)
def fused_optimizer_ema_mode_dropped() -> ContextManager[None]:
    """The sharders drop EMA in-place row-wise Adagrad's emainplace_mode: fbgemm's default EMA runs instead.

    fbgemm's default moves the slow half every 10 steps from step 0 with coefficient 0.6, so the
    drawn period, start and coefficient are lost."""
    return _merged_fused_params(lambda merged: merged.pop("emainplace_mode", None))


@register("ebc-fused-optimizer-type-from-class", check=CHECK)
def ebc_fused_optimizer_type_from_class() -> ContextManager[None]:
    """The EBC sharder takes the fused optimizer from the class, ignoring an explicit optimizer= keyword.

    The class of EMA in-place row-wise Adagrad and row-wise RMSprop is RowWiseAdagrad, so the tables
    train with plain row-wise Adagrad (what the EC sharder does on 1.8 and 1.9)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import embeddingbag

    explicit = {getattr(EmbOptimType, name) for name in ("EMAINPLACE_ROWWISE_ADAGRAD", "ROWWISE_RMSPROP_AR") if hasattr(EmbOptimType, name)}

    def planted(original):
        def merge(fused_params=None, param_fused_params=None):
            merged = original(fused_params, param_fused_params)
            if merged.get("optimizer") in explicit:
                merged["optimizer"] = EmbOptimType.EXACT_ROWWISE_ADAGRAD
            return merged

        return merge

    return replaced(embeddingbag, "merge_fused_params", planted)


@register("fused-optimizer-state-named-by-index", check=CHECK)
def fused_optimizer_state_named_by_index() -> ContextManager[None]:
    """The fused optimizer names its states momentum1, momentum2, ... by position, not by fbgemm's names.

    fbgemm's prev_iter, row_counter and iter become momentum2, momentum3, ...: a checkpoint keyed by
    torchrec's names misses them."""
    from torchrec.distributed.batched_embedding_kernel import EmbeddingFusedOptimizer

    def planted(original):
        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            for entries in self.state.values():
                names = list(entries)
                for index, name in enumerate(names):
                    table, _, state = name.rpartition(".")
                    if state != "momentum1":
                        entries[f"{table}.momentum{index + 1}"] = entries.pop(name)

        return init

    return replaced(EmbeddingFusedOptimizer, "__init__", planted)


@register("twrw-input-dist-not-staggered", check=CHECK)
def twrw_input_dist_not_staggered() -> ContextManager[None]:
    """TWRW's (and GRID's) input all-to-all forgets to stagger by the number of hosts: a rank reads the
    ids it received from the other hosts' ranks in plain rank order, so its pooled rows go to other
    samples. One host has nothing to stagger; only ranks on several hosts show it."""
    from torchrec.distributed.sharding import twrw_sharding

    def planted(original):
        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self._dist._stagger = 1

        return init

    return replaced(twrw_sharding.TwRwSparseFeaturesDist, "__init__", planted)


@register("twrw-input-staggered-by-ranks-per-host", check=CHECK)
def twrw_input_staggered_by_ranks_per_host() -> ContextManager[None]:
    """TWRW's (and GRID's) input all-to-all staggers by the ranks per host instead of the host count:
    the same number on a square layout (2x2), so only hosts of another count than their ranks (3x2) show it."""
    from torchrec.distributed.sharding import twrw_sharding

    def planted(original):
        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self._dist._stagger = self._local_size

        return init

    return replaced(twrw_sharding.TwRwSparseFeaturesDist, "__init__", planted)


@register("grid-blocks-in-host-order", check=CHECK)
def grid_blocks_in_host_order() -> ContextManager[None]:
    """GRID stitches a table's column blocks in the order of the hosts holding them instead of their
    column offsets: a table whose host indexes are not ascending (grid_shard([1, 0])) returns its
    columns swapped. On one host every block is on host 0, in column order: nothing to see there."""
    from torchrec.distributed.sharding.grid_sharding import BaseGridEmbeddingSharding

    def planted(original):
        def combine(self):
            original(self)
            names = self._embedding_names
            self._embedding_order = [i for name in self._combined_embedding_names for i, n in enumerate(names) if n == name]

        return combine

    return replaced(BaseGridEmbeddingSharding, "_init_combined_embeddings", planted)


# The DMP and collectives plants live beside their cases; importing them registers them here.
from paritykit.checks.sharding import dmp_plants  # noqa: E402,F401
from paritykit.checks.sharding import fp_plants  # noqa: E402,F401
from paritykit.checks.sharding import dmp_state_plants  # noqa: E402,F401
from paritykit.checks.sharding import plan_plants  # noqa: E402,F401
from paritykit.checks.sharding import tower_plants  # noqa: E402,F401
