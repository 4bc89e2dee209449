"""Tolerances derived from how a number is computed, for comparisons torchrec does not promise bit
for bit (a pooled embedding or a gradient that two paths may sum in different orders).

A sum of n terms computed in floating point is off by at most gamma(n) * sum(|x_i|), with
gamma(n) = n*u / (1 - n*u) and u the unit roundoff of the dtype (Higham, "Accuracy and Stability
of Numerical Algorithms", 2nd ed., eq. 4.4). With every |x_i| <= magnitude, sum(|x_i|) <= n *
magnitude. Two paths that each satisfy this differ by at most twice the bound. A final scaling
(MEAN pooling's division, a learning rate) rounds once more on each path: 2u relative.

So a comparison of two such results passes |a - e| <= atol + rtol * |e| with
    atol = 2 * gamma(n) * n * magnitude,   rtol = 4 * u.
For float32, n = 12 and magnitude 4 that is atol 6.9e-5, rtol 2.4e-7: far below a consistent 1e-3
relative drift of values of order one, which therefore fails.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the largest relative error of one rounding in ``dtype``."""
    return torch.finfo(dtype).eps / 2


def summation_tolerance(dtype: torch.dtype, terms: int, magnitude: float) -> tuple[float, float]:
    """(rtol, atol) for two computations of a sum of ``terms`` values, each at most ``magnitude``."""
    if terms < 0 or magnitude < 0:
        raise ValueError(f"terms and magnitude must be non-negative, got {terms} and {magnitude}")
    u = unit_roundoff(dtype)
    n = max(int(terms), 1)
    if n * u >= 1:
        raise ValueError(f"{n} terms in {dtype} have no meaningful rounding bound (n * u >= 1)")
    gamma = n * u / (1 - n * u)
    return 4 * u, 2 * gamma * n * float(magnitude)


# Units of roundoff a norm-wise comparison allows (see ``normwise_bound``).
NORMWISE_UNITS = 64


def normwise_bound(dtype: torch.dtype, units: int = NORMWISE_UNITS) -> tuple[float, float]:
    """(rtol, max_relative) for two computations of the same tensor that differ in summation order and
    in which kernels they run (a sharded model against the unsharded one, a batched kernel against
    torch's): |a - e| <= units * u * (|e| + max|e|).

    Rounding errors of sums are bounded relative to the sum of the terms' magnitudes (see
    ``summation_tolerance``), which for a whole network is not known in closed form; the largest
    element of the compared tensor stands for it. Measured on sharded training (EBC/EC + MLP, every
    placement, SGD/Adagrad/row-wise Adagrad, 3 steps, float32) the worst difference was 5.4 units of
    that; 64 units keeps a tenfold margin, covers torchrec's deliberate 1e-6 in the row-wise MEAN
    divisor (17 units in float32), and stays about 130 times below a consistent 1e-3 relative drift.
    """
    u = unit_roundoff(dtype)
    return units * u, units * u
