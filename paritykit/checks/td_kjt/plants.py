"""Planted bugs for the td-kjt check's negative controls: in paritykit's TensorDict -> KJT
conversion, and in torchrec's sharded KJT/VBE paths (which only the unsharded oracle can see)."""

from __future__ import annotations

from typing import ContextManager

import torch

import paritykit.convert as convert  # noqa: PLR0402 - "from paritykit import" would import the facade
from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "td-kjt"


def _patched(name: str, replacement) -> ContextManager[None]:
    return replaced(convert, name, replacement)


@register("offsets-off-by-one", check=CHECK)
def offsets_off_by_one():
    """Every inner row boundary of the first feature moves one position later."""

    def replacement(original):
        def lengths_from_offsets(offsets, batch_sizes, variable_batch):
            shifted = offsets[0].clone()
            if shifted.numel() > 2:
                shifted[1:-1] = torch.minimum(shifted[1:-1] + 1, shifted[-1])
            return original([shifted, *offsets[1:]], batch_sizes, variable_batch)

        return lengths_from_offsets

    return _patched("_lengths_from_offsets", replacement)


@register("feature-key-swap", check=CHECK)
def feature_key_swap():
    """The first two keys trade names; their data stays where it was."""

    def replacement(original):
        def assemble(keys, features):
            swapped = list(keys)
            if len(swapped) > 1:
                swapped[0], swapped[1] = swapped[1], swapped[0]
            return original(swapped, features)

        return assemble

    return _patched("_assemble", replacement)


@register("weights-dropped", check=CHECK)
def weights_dropped():
    """Weights are silently left out of the KJT, as torchrec's own conversion does."""

    def replacement(original):
        def assemble(keys, features):
            for feature in features:
                feature.weights = None
            return original(keys, features)

        return assemble

    return _patched("_assemble", replacement)


# ---------------------------------------------------------------- sharded TD/KJT/VBE paths in torchrec
# These break the sharded module for every input form alike, so a sharded TensorDict compared only
# with the same sharded module fed a KJT cannot see them; the unsharded oracle does.


@register("vbe-inverse-indices-unpermuted", check=CHECK)
def vbe_inverse_indices_unpermuted() -> ContextManager[None]:
    """Sharded EBC expands a VBE batch by inverse indices in input key order, not in the plan's feature order."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    def planted(original):
        def create(self, inverse_indices):
            original(self, inverse_indices)
            if self._inverse_indices_permute_indices is not None:
                self._inverse_indices_permute_indices = self._inverse_indices_permute_indices.sort().values

        return create

    return replaced(ShardedEmbeddingBagCollection, "_create_inverse_indices_permute_indices", planted)


@register("ec-vbe-inverse-indices-unpermuted", check=CHECK)
def ec_vbe_inverse_indices_unpermuted() -> ContextManager[None]:
    """Sharded EC expands a VBE batch by inverse indices in input key order within each sharding."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    def planted(original):
        def create(self, inverse_indices):
            original(self, inverse_indices)
            permutes = self._inverse_indices_permute_per_sharding
            if permutes is not None:
                self._inverse_indices_permute_per_sharding = [p.sort().values for p in permutes]

        return create

    return replaced(ShardedEmbeddingCollection, "_create_inverse_indices_permute_per_sharding", planted)


@register("split-weights-not-offset", check=CHECK)
def split_weights_not_offset() -> ContextManager[None]:
    """KJT.split gives each piece the per-id weights from the start of the batch, not from the piece's offset.

    The sharded EBC splits its input by sharding type; the unsharded EBC never splits, so only the
    sharded per-id weights land on the wrong ids (in every piece after the first).
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def planted(original):
        def split(self, segments):
            pieces = original(self, segments)
            weights = self.weights_or_none()
            if weights is not None:
                for piece in pieces[1:]:
                    if piece.weights_or_none() is not None:
                        piece._weights = weights[: piece.weights().numel()]
            return pieces

        return split

    return replaced(KeyedJaggedTensor, "split", planted)


@register("vbe-gradient-not-divided", check=CHECK)
def vbe_gradient_not_divided() -> ContextManager[None]:
    """The variable-batch pooled all-to-all's backward skips torchrec's gradient division by the world size."""
    import torch.distributed as dist
    from torchrec.distributed import comm_ops

    def planted(original):
        def backward(ctx, *grads):
            out = original(ctx, *grads)
            if comm_ops.get_gradient_division() and out[3] is not None:
                out[3].mul_(dist.get_world_size(ctx.pg))
            return out

        return staticmethod(backward)

    return replaced(comm_ops.Variable_Batch_All2All_Pooled_Req, "backward", planted)


@register("twrw-output-split-by-host-index", check=CHECK)
def twrw_output_split_by_host_index() -> ContextManager[None]:
    """TWRW's output dist, fed batches of different sizes on the ranks, splits a rank's pooled rows by the
    batch sizes of its host index instead of its rank within the host (``rank // ranks_per_host`` for
    ``rank % ranks_per_host``). Equal batches on every rank, or one host's rank 0, hide it."""
    from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist

    def planted(original):
        def preprocess(self, local_size, nodes, batch_size_per_rank):
            by_cross_group, sums = original(self, local_size, nodes, batch_size_per_rank)
            wrong = list(by_cross_group)
            wrong[self._rank % local_size] = by_cross_group[self._rank // local_size]  # IndexError on a third host
            return wrong, sums

        return preprocess

    return replaced(TwRwPooledEmbeddingDist, "_preprocess_batch_size_per_rank", planted)
