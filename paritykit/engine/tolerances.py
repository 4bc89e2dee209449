"""How close a sharded run must come to the unsharded reference, and why.

torchrec does not promise bit-identical numbers between a sharded and an unsharded module: shards
pool partial sums that a reduce-scatter adds in another order, batched kernels accumulate
gradients of repeated ids in their own order, and row-wise MEAN pooling divides by (length + 1e-6).
Every compared tensor is therefore held to the norm-wise bound of paritykit.compare.bounds
(``normwise_bound``: 64 units of roundoff of the tensor's dtype, relative to the tensor's largest
element), which the measured worst case stays ten times below and a consistent 1e-3 relative drift
exceeds a hundredfold. A gather is exact: at the first step, before any update, an
EmbeddingCollection's lookups (values, lengths, indices) are compared bit for bit
(``exact_first_lookups``); after an update the tables themselves carry the rounding of the gradients.
"""

from __future__ import annotations

import torch

from paritykit.engine.comparison import EXACT, Bound, Tolerance
from paritykit.compare.bounds import NORMWISE_UNITS, normwise_bound


def normwise(dtype: torch.dtype = torch.float32) -> Bound:
    rtol, max_relative = normwise_bound(dtype)
    return Bound(rtol=rtol, max_relative=max_relative, why=f"{NORMWISE_UNITS} units of {dtype} roundoff, norm-wise")


def default_tolerance(dtype: torch.dtype = torch.float32, exact_first_lookups: bool = False) -> Tolerance:
    bound = normwise(dtype)
    return Tolerance(embeddings=bound, first_step_embeddings=EXACT if exact_first_lookups else bound, outputs=bound,
                     losses=bound, state=bound, optimizer_state=bound)


def tolerance_for(setup: object) -> Tolerance:
    """The default for a user's model: every number within the norm-wise bound."""
    return default_tolerance()


def codec_tolerance(dtype: torch.dtype, world_size: int) -> Tolerance:
    """The bound for a run whose embeddings travel through a quantized-communication codec of ``dtype``.

    The codec rounds each value it sends once (an all-to-all), and a reduce-scatter over W ranks adds
    W rounded partial sums in ``dtype``: at most 2W - 1 roundings of ``dtype`` between a pooled embedding
    and the unsharded one. The backward's codec rounds the gradient once more, which moves the tables by
    a learning rate times that. So every compared number is held to 2 (2W - 1) units of ``dtype``'s
    roundoff, norm-wise (float16, two ranks: 6 units, 2.9e-3 of the tensor's largest element; measured
    at most 0.7 unit on paritykit's cases). The losses, a weighted sum of every output element, can
    cancel far below their terms: they keep the norm-wise default in ``dtype``. Nothing is exact.
    """
    from paritykit.compare.bounds import normwise_bound

    rtol, max_relative = normwise_bound(dtype, units=2 * (2 * world_size - 1))
    bound = Bound(rtol=rtol, max_relative=max_relative, why=f"{2 * (2 * world_size - 1)} units of the {dtype} codec's roundoff")
    return Tolerance(embeddings=bound, first_step_embeddings=bound, outputs=bound, losses=normwise(dtype), state=bound,
                     optimizer_state=bound)
