"""Planted bugs that the `modules` check must catch: each a realistic slip in torchrec.modules.

Each one changes what torchrec computes (tests/test_modules_plants.py shows it on torchrec alone
first), and a pinned case of the check catches it with the self-test's few examples.
"""

from __future__ import annotations

from typing import ContextManager

import torch

from paritykit.harness.patching import replaced, replaced_all
from paritykit.harness.plants import register

CHECK = "modules"


@register("cross-layer-uses-x-l-for-x0", check=CHECK)
def cross_layer_uses_x_l_for_x0() -> ContextManager[None]:
    """CrossNet's layers multiply by x_l where the formula has x_0 (x_{l+1} = x_l * (W x_l + b) + x_l)."""
    from torchrec.modules.crossnet import CrossNet

    def forward(self, input):
        x_l = input.unsqueeze(2)
        for layer in range(self._num_layers):
            x_l = x_l * (torch.matmul(self.kernels[layer], x_l) + self.bias[layer]) + x_l
        return torch.squeeze(x_l, dim=2)

    return replaced(CrossNet, "forward", lambda _original: forward)


@register("low-rank-factor-transposed", check=CHECK)
def low_rank_factor_transposed() -> ContextManager[None]:
    """LowRankCrossNet applies its factors as x_l W V (transposed) instead of W (V x_l)."""
    from torchrec.modules.crossnet import LowRankCrossNet

    def forward(self, input):
        x_0 = x_l = input
        for layer in range(self._num_layers):
            x_l_w = torch.matmul(torch.matmul(x_l, self.W_kernels[layer]), self.V_kernels[layer])
            x_l = x_0 * (x_l_w + self.bias[layer]) + x_l
        return x_l

    return replaced(LowRankCrossNet, "forward", lambda _original: forward)


@register("vector-cross-bias-inside-product", check=CHECK)
def vector_cross_bias_inside_product() -> ContextManager[None]:
    """VectorCrossNet adds its bias inside the product with x_0 (x_0 (x_l . w + b) + x_l), not after it."""
    from torchrec.modules.crossnet import VectorCrossNet

    def forward(self, input):
        x_0 = x_l = input.unsqueeze(2)
        for layer in range(self._num_layers):
            xl_w = torch.tensordot(x_l, self.kernels[layer], dims=([1], [0]))
            x_l = x_0 * (xl_w + self.bias[layer]) + x_l
        return torch.squeeze(x_l, dim=2)

    return replaced(VectorCrossNet, "forward", lambda _original: forward)


@register("mixture-gating-softmax-over-batch", check=CHECK)
def mixture_gating_softmax_over_batch() -> ContextManager[None]:
    """LowRankMixtureCrossNet normalizes its gates with a softmax over the batch instead of the experts."""
    import torchrec.modules.crossnet as crossnet

    real_softmax = torch.nn.functional.softmax

    class _Functional:
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def softmax(gating, dim=None, *args, **kwargs):
            return real_softmax(gating, 0 if dim == 1 else dim, *args, **kwargs)

    class _Nn:
        functional = _Functional()

        def __getattr__(self, name):
            return getattr(torch.nn, name)

    class _Torch:
        nn = _Nn()

        def __getattr__(self, name):
            return getattr(torch, name)

    return replaced(crossnet, "torch", lambda _original: _Torch())


@register("fm-over-field-axis", check=CHECK)
def fm_over_field_axis() -> ContextManager[None]:
    """FactorizationMachine crosses the fields per embedding dimension (the paper's axis) instead of
    every flattened input, whenever all embeddings have one dimension."""
    from torchrec.modules.deepfm import FactorizationMachine

    def planted(original):
        def forward(self, embeddings):
            if len({e.shape[-1] for e in embeddings}) != 1:
                return original(self, embeddings)
            fields = torch.cat(list(embeddings), dim=1)  # (B, N, D)
            square_of_sum = fields.sum(dim=1) ** 2
            sum_of_square = (fields * fields).sum(dim=1)
            return 0.5 * (square_of_sum - sum_of_square).sum(dim=1, keepdim=True)

        return forward

    return replaced(FactorizationMachine, "forward", planted)


@register("mlp-drops-last-activation", check=CHECK)
def mlp_drops_last_activation() -> ContextManager[None]:
    """MLP leaves its last Perceptron without an activation, as if activation_on_last were False."""
    from torchrec.modules.mlp import MLP

    def planted(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if hasattr(self, "_mlp") and len(self._mlp):
                self._mlp[-1]._activation_fn = torch.nn.Identity()

        return __init__

    return replaced(MLP, "__init__", planted)


@register("swish-layernorm-last-dim-only", check=CHECK)
def swish_layernorm_last_dim_only() -> ContextManager[None]:
    """SwishLayerNorm normalizes over the last dimension only, whatever input_dims names."""
    from torchrec.modules.activation import SwishLayerNorm

    def planted(original):
        def __init__(self, input_dims, device=None):
            last = input_dims if isinstance(input_dims, int) else list(input_dims)[-1]
            original(self, last, device)

        return __init__

    return replaced(SwishLayerNorm, "__init__", planted)


@register("mch-default-slot-off-by-one", check=CHECK)
def mch_default_slot_off_by_one() -> ContextManager[None]:
    """MCHManagedCollisionModule maps ids without a slot to offset + zch_size, one past its range."""
    import torchrec.modules.mc_modules as mc_modules

    def planted(original):
        def remap(features, sorted_raw_ids, remapped_ids_mapping, zch_index):
            return original(features, sorted_raw_ids, remapped_ids_mapping, zch_index + 1)

        return remap

    return replaced(mc_modules, "_mch_remap", planted)


@register("mch-input-hash-not-applied", check=CHECK)
def mch_input_hash_not_applied() -> ContextManager[None]:
    """MCHManagedCollisionModule remaps the raw ids, not the ids its ``input_hash_func`` makes of them."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    return replaced(MCHManagedCollisionModule, "preprocess", lambda _original: lambda self, features: features)


@register("threshold-filter-passes-ties", check=CHECK)
def threshold_filter_passes_ties() -> ContextManager[None]:
    """The MCH threshold filters pass an id whose window count equals the threshold (``>=`` for ``>``)."""
    from torchrec.modules import mc_modules

    def average(id_counts):
        threshold = id_counts.float().mean()
        return id_counts >= threshold, threshold

    def dynamic(id_counts, threshold_skew_multiplier=10.0):
        threshold = 1 / id_counts.numel() * threshold_skew_multiplier * id_counts.sum()
        return id_counts >= threshold, threshold

    return replaced_all([(mc_modules, "average_threshold_filter", lambda _original: average),
                         (mc_modules, "dynamic_threshold_filter", lambda _original: dynamic)])


@register("lfu-ties-favour-new-ids", check=CHECK)
def lfu_ties_favour_new_ids() -> ContextManager[None]:
    """LFU eviction lets a new id with as many hits as a held one take its slot (ties go to the newcomer)."""
    from torchrec.modules.mc_modules import MCHEvictionPolicy

    def planted(original):
        def select(self, pivot, eviction_scores):
            # Held ids come first in the scores: reversing each tie's order hands ties to new ids.
            ranks = torch.arange(eviction_scores.numel(), dtype=torch.float64) / (eviction_scores.numel() + 1)
            keep_max = eviction_scores == torch.iinfo(torch.int64).max
            nudged = torch.where(keep_max, eviction_scores.double(), eviction_scores.double() + ranks)
            return original(self, pivot, nudged)

        return select

    return replaced(MCHEvictionPolicy, "_compute_selected_eviction_and_replacement_indices", planted)


@register("lru-keeps-least-recent", check=CHECK)
def lru_keeps_least_recent() -> ContextManager[None]:
    """LRU eviction ranks its scores the wrong way round: the ids seen longest ago keep their slots."""
    from torchrec.modules.mc_modules import LRU_EvictionPolicy

    def planted(original):
        def select(self, pivot, eviction_scores):
            return original(self, pivot, torch.where(eviction_scores == -1, eviction_scores, -1.0 / eviction_scores))

        return select

    return replaced(LRU_EvictionPolicy, "_compute_selected_eviction_and_replacement_indices", planted)


@register("dlrm-interaction-keeps-self-dots", check=CHECK)
def dlrm_interaction_keeps_self_dots() -> ContextManager[None]:
    """DLRM's InteractionArch takes the upper triangle with its diagonal (every feature's dot with itself:
    ``triu_indices(offset=0)``), so its output grows by F + 1 columns and the over-arch reads other pairs."""
    from torchrec.models.dlrm import InteractionArch

    def planted(original):
        def init(self, num_sparse_features):
            original(self, num_sparse_features)
            self.triu_indices = torch.triu_indices(self.F + 1, self.F + 1, offset=0)

        return init

    return replaced(InteractionArch, "__init__", planted)


@register("mc-evicted-rows-keep-their-embedding", check=CHECK)
def mc_evicted_rows_keep_their_embedding() -> ContextManager[None]:
    """A sharded MC-EC/EBC gives an evicted id's slot to a new id without re-initializing its row: the new
    id inherits the trained embedding of the id it replaces (caught on the ranks: mc_sharded_cases.py)."""
    from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection

    return replaced(BaseShardedManagedCollisionEmbeddingCollection, "_evict", lambda _original: lambda self, evictions: None)


@register("tensor-pool-update-keeps-first-duplicate", check=CHECK)
def tensor_pool_update_keeps_first_duplicate() -> ContextManager[None]:
    """TensorPool.update keeps the first of an id given twice, where its docstring keeps the last."""
    import torchrec.modules.tensor_pool as tensor_pool

    def planted(original):
        def first_existence(ids):
            reversed_ids = ids.flip(0)
            unique, positions = original(reversed_ids)
            return unique, ids.numel() - 1 - positions

        return first_existence

    return replaced(tensor_pool, "deterministic_dedup", planted)


@register("sharded-tensor-pool-lookup-not-unbucketized", check=CHECK)
def sharded_tensor_pool_lookup_not_unbucketized() -> ContextManager[None]:
    """ShardedTensorPool returns a lookup's rows in shard order, not in the order of the ids asked for
    (the unbucketize permutation skipped; caught on the ranks: pool_cases.py)."""
    from torchrec.distributed.tensor_pool import TensorPoolAwaitable

    return replaced(TensorPoolAwaitable, "_wait_impl", lambda _original: lambda self: self._awaitable.wait())
