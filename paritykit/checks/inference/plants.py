"""Planted bugs that the `inference` check must catch: each a realistic slip in torchrec's inference
sharding. Each changes what torchrec computes (tests/test_inference.py shows it on torchrec alone
first), and a pinned case of the check catches it with the self-test's few examples."""

from __future__ import annotations

from typing import ContextManager

import torch

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "inference"


@register("infer-cw-shards-not-permuted", check=CHECK)
def infer_cw_shards_not_permuted() -> ContextManager[None]:
    """A column-wise inference table's shards are merged in rank order, without the permutation back to column order."""
    from torchrec.distributed.sharding.cw_sharding import InferCwPooledEmbeddingDistWithPermute

    def forward(self, local_embs, sharding_ctx=None):
        return self._dist(local_embs)

    return replaced(InferCwPooledEmbeddingDistWithPermute, "forward", lambda _original: forward)


@register("infer-rw-reduce-drops-last-rank", check=CHECK)
def infer_rw_reduce_drops_last_rank() -> ContextManager[None]:
    """The row-wise inference reduce sums every rank's partial pooled embeddings but the last one's."""
    from torchrec.distributed.dist_data import EmbeddingsAllToOneReduce

    def forward(self, tensors):
        kept = list(tensors[:-1]) or [torch.zeros_like(tensors[0])]
        return torch.ops.fbgemm.sum_reduce_to_one(kept, self._device)

    return replaced(EmbeddingsAllToOneReduce, "forward", lambda _original: forward)


@register("infer-rw-sequence-not-unbucketized", check=CHECK)
def infer_rw_sequence_not_unbucketized() -> ContextManager[None]:
    """A row-wise inference EC returns its rows in the shards' order, not put back in the input's id order."""
    from torchrec.distributed import quant_embedding

    def construct(original):
        def without_unbucketize(embeddings, feature_keys, feature_length, feature_indices, need_indices, unbucketize_tensor):
            identity = torch.arange(unbucketize_tensor.numel(), dtype=unbucketize_tensor.dtype, device=unbucketize_tensor.device)
            return original(embeddings, feature_keys, feature_length, feature_indices, need_indices, identity)
        return without_unbucketize

    return replaced(quant_embedding, "_construct_jagged_tensors_rw", construct)
