"""Numbers for the sparse-op references, in plain Python: exactly representable in their dtype.

The references hold values as Python ints and floats. A float drawn here is already rounded to its
dtype (with ``struct``'s IEEE half and single formats), so a tensor built from it holds the same
number and a value that an op only moves can be compared bit for bit.
"""

from __future__ import annotations

import random
import struct

INT_DTYPES = ("int32", "int64")
FLOAT_DTYPES = ("float16", "float32", "float64")
LENGTHS_DTYPES = ("int32", "int64")
# Ids are drawn below this bound (a table's rows); int32 holds them.
ID_BOUND = 1_000_000
# Gradients flowing into an op are multiples of 1/16 of magnitude at most 4 (see dyadic_upstream).
UPSTREAM_STEP = 1 / 16
UPSTREAM_MAX_STEPS = 64


def round_to(dtype: str, number: float) -> float:
    """``number`` rounded to ``dtype`` (round to nearest even), as a Python float."""
    if dtype == "float16":
        return struct.unpack("<e", struct.pack("<e", number))[0]
    if dtype == "float32":
        return struct.unpack("<f", struct.pack("<f", number))[0]
    if dtype == "float64":
        return float(number)
    raise ValueError(f"not a floating dtype: {dtype!r}")


def draw_number(rng: random.Random, dtype: str) -> int | float:
    """One value of ``dtype``: an id for integer dtypes, a float exactly representable in ``dtype``."""
    if dtype in INT_DTYPES:
        return rng.randrange(ID_BOUND)
    if dtype == "float16":
        # k/16 with |k| <= 2048: 11 significant bits at most, exact in float16.
        return rng.randint(-2048, 2048) / 16
    return round_to(dtype, rng.uniform(-8.0, 8.0))


def draw_values(rng: random.Random, dtype: str, count: int, dim: int = 0) -> tuple:
    """``count`` values; with ``dim`` > 0 each value is a row of ``dim`` numbers (a 2-D values tensor)."""
    if dim:
        return tuple(tuple(draw_number(rng, dtype) for _ in range(dim)) for _ in range(count))
    return tuple(draw_number(rng, dtype) for _ in range(count))


def dyadic_upstream(rng: random.Random, count: int) -> tuple[float, ...]:
    """Upstream gradients: multiples of 1/16 with magnitude at most 4.

    A sum of n <= 32 of them is exact in float16, float32 and float64: every partial sum is a
    multiple of 1/16 below 2**7, which needs at most 11 significant bits (float16 has 11). So the
    references' gradient sums are exact whatever the order torch adds in, and gradients compare bit
    for bit; paritykit.compare.bounds' summation bound is zero here. ``MAX_SUMMED_TERMS`` guards it.
    """
    return tuple(rng.randint(-UPSTREAM_MAX_STEPS, UPSTREAM_MAX_STEPS) * UPSTREAM_STEP for _ in range(count))


# The most upstream gradients one reference gradient element may sum (see dyadic_upstream).
MAX_SUMMED_TERMS = 32
