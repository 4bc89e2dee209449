"""Planted bugs that move the numbers on both sides of every comparison: only golden fixtures see them."""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "fixtures"


@register("fp16-pooling-accumulation", check=CHECK)
def fp16_pooling_accumulation() -> ContextManager[None]:
    """Embedding-bag pooling accumulates in float16 instead of float32 (then casts back).

    The TensorDict and KJT paths go through the same kernel, so they still agree with each other.
    """
    import torch
    import torch.nn.functional as F

    def planted(original):
        def forward_in_half(self, input, offsets=None, per_sample_weights=None):
            pooled = F.embedding_bag(
                input,
                self.weight.half(),
                offsets,
                self.max_norm,
                self.norm_type,
                self.scale_grad_by_freq,
                self.mode,
                self.sparse,
                None if per_sample_weights is None else per_sample_weights.half(),
                self.include_last_offset,
                self.padding_idx,
            )
            return pooled.float()

        return forward_in_half

    return replaced(torch.nn.EmbeddingBag, "forward", planted)
