"""How close torchrec's dense modules must come to their formula, and why.

The formula runs in float64 (dense_cases.py), so the difference is torchrec's own rounding in the
drawn dtype. Two parts:

1. The norm-wise bound of paritykit.compare.bounds (64 units of roundoff of the dtype, relative to
   the largest element), as for a sharded model against the unsharded one: the rounding of chains of
   dot products. The output is one tensor; the gradients are one vector (the gradient of the loss
   with respect to every input and parameter), each held relative to the largest element of all.
2. Cancellation. A result far smaller than the terms it is summed from carries their rounding, not
   its own: a cross layer whose x_0 * (W x_l + b) nearly cancels x_l, a LayerNorm over values that are
   almost equal (its gradient passes through 1 / sqrt(var + eps)), a mixture's gate whose experts are
   alike. How much the formula suffers at this point is measured by evaluating the same formula in
   float32 and comparing with float64: ``noise`` = max |formula_f32 - formula_f64| over the tensor
   (over every gradient, for the gradients), scaled by u(dtype) / u(float32) for float64 runs. torchrec
   evaluates the same formula in another order, so its error is of that order; it may be
   ``CANCELLATION_FACTOR`` times larger (the worst ratio measured over 300 draws per family at 5 seeds was
   2.35 (SwishLayerNorm normalized over 4+ elements, draws.py): docs/modules.md).

The bound is the sum. A planted bug (a layer reading x_l for x_0, a transposed factor, a softmax over
the batch) moves the numbers by the size of the terms, orders of magnitude above it.

The factorization machine is 0.5 * ((sum x)^2 - sum x^2) over the M flattened inputs of a sample: its
cancellation is known in closed form, so its bound is derived instead. With gamma(M) = M u / (1 - M u)
(Higham, eq. 4.4) and S = max over samples of sum |x|: sum x within gamma(M) S; its square within
(2 gamma(M) + gamma(M)^2 + u) S^2; sum x^2 within gamma(M) S^2; the difference and the halving round
twice more: output atol (3 gamma(M) + gamma(M)^2 + 3u) S^2. Its gradient g (s - x_k) (g the upstream
gradient): atol max|g| (gamma(M) + 8u) S. Both add 4u relative.
"""

from __future__ import annotations

import torch

from paritykit.compare.bounds import NORMWISE_UNITS, normwise_bound, unit_roundoff
from paritykit.engine.comparison import Bound

# How many times the formula's own float32 rounding (scaled to the dtype) torchrec's may reach.
CANCELLATION_FACTOR = 16


def _gamma(terms: int, dtype: torch.dtype) -> float:
    u = unit_roundoff(dtype)
    return terms * u / (1 - terms * u)


def factorization_machine_bounds(inputs: list[torch.Tensor], dtype: torch.dtype, upstream_max: float) -> tuple[Bound, Bound]:
    """(output bound, gradient bound) of FactorizationMachine for these inputs; ``upstream_max`` is
    the largest element of the upstream gradient."""
    flat = torch.cat([t.detach().reshape(t.shape[0], -1) for t in inputs], dim=1).to(torch.float64)
    terms = flat.shape[1]
    s = float(flat.abs().sum(dim=1).max()) if flat.numel() else 0.0
    u, gamma = unit_roundoff(dtype), _gamma(terms, dtype)
    forward = Bound(rtol=4 * u, atol=(3 * gamma + gamma * gamma + 3 * u) * s * s,
                    why=f"the FM's cancelling squared sums: (3 gamma({terms}) + gamma^2 + 3u) (sum|x|)^2 in {dtype}")
    gradient = Bound(rtol=4 * u, atol=upstream_max * (gamma + 8 * u) * s,
                     why=f"the FM's gradient: max|g| (gamma({terms}) + 8u) sum|x| in {dtype}")
    return forward, gradient


def largest(tensors: list[torch.Tensor | None]) -> float:
    return max((float(t.detach().abs().max()) for t in tensors if t is not None and t.numel()), default=0.0)


def noise(in_float32: list[torch.Tensor | None], in_float64: list[torch.Tensor | None], dtype: torch.dtype) -> float:
    """The formula's own rounding at this point: max |f32 - f64| over the tensors, scaled to ``dtype``."""
    diffs = [a.detach().to(torch.float64) - b.detach() for a, b in zip(in_float32, in_float64) if a is not None and b is not None]
    return largest(diffs) * unit_roundoff(dtype) / unit_roundoff(torch.float32)


def normwise_with_cancellation(dtype: torch.dtype, largest_expected: float, formula_noise: float, what: str) -> Bound:
    rtol, max_relative = normwise_bound(dtype)
    return Bound(rtol=rtol, atol=max_relative * largest_expected + CANCELLATION_FACTOR * formula_noise,
                 why=f"{NORMWISE_UNITS} units of {dtype} roundoff norm-wise over {what}, + {CANCELLATION_FACTOR} x "
                     f"the formula's own rounding {formula_noise:.3g}")
