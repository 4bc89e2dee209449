"""Structural comparison with a tolerance policy; the one place that decides "equal".

``assert_close(actual, expected)`` walks tensors, nested (jagged) tensors, JaggedTensor,
KeyedJaggedTensor, KeyedTensor, TensorDict, mappings (state dicts included, with ShardedTensor or
DTensor values), lists and tuples, and raises ``ParityError`` whose message alone locates every
difference: its path (``kjt['f3'].values[17]``, ``state['ebc.t0.weight'][4, 2]``), expected vs
actual, the max abs/rel error and how many elements differ out of how many.

Tolerance policy:
- integer and bool tensors are always compared exactly;
- floating tensors use torch.testing's per-dtype defaults unless ``rtol``/``atol`` are given;
- ``exact=True`` claims bit-identity: the bit patterns must match, so ``-0.0`` differs from
  ``0.0`` and a NaN equals only a NaN with the same payload.
- Outside exact mode NaN equals NaN in the same position (a NaN produced on both paths is
  parity, not a difference) and ``-0.0`` equals ``0.0``.

Structure differences (a missing or extra key, key order of a KJT/KeyedTensor/TensorDict, stride,
lengths, shape, dtype, a weights tensor present on one side only) are reported as ``structure``,
separately from ``value`` differences, and the walk does not compare values below a structure
difference (they would only repeat it).
"""
from __future__ import annotations

from typing import Any

from paritykit.compare.policy import DEFAULT_TOLERANCES, MAX_REPORTED_DIFFERENCES, Difference, Policy
from paritykit.compare.walk import kind_of, walk
from paritykit.errors import ParityError

__all__ = ["DEFAULT_TOLERANCES", "Difference", "assert_close", "find_differences", "format_differences", "max_abs_diff"]


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    exact: bool = False,
    msg: str | None = None,
    name: str | None = None,
    max_relative: float = 0.0,
) -> None:
    """Raise ParityError listing where ``actual`` and ``expected`` differ; return None if they agree.

    ``max_relative`` makes the bound norm-wise: each compared tensor's atol grows by
    ``max_relative * max(|expected|)`` of that tensor (see paritykit.compare.bounds).
    """
    differences = find_differences(actual, expected, rtol=rtol, atol=atol, exact=exact, name=name, max_relative=max_relative)
    if differences:
        raise ParityError(format_differences(differences, msg=msg, exact=exact))


def find_differences(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    exact: bool = False,
    name: str | None = None,
    max_relative: float = 0.0,
) -> list[Difference]:
    """Every difference (up to MAX_REPORTED_DIFFERENCES), in walk order."""
    if (rtol is None) != (atol is None):
        raise ValueError("give both rtol and atol, or neither (then the per-dtype defaults apply)")
    if max_relative < 0:
        raise ValueError(f"max_relative must be non-negative, got {max_relative}")
    out: list[Difference] = []
    walk(actual, expected, name or _root_name(expected), Policy(rtol, atol, exact, max_relative), out)
    return out[:MAX_REPORTED_DIFFERENCES]


def max_abs_diff(actual: Any, expected: Any) -> float:
    """The largest absolute difference over matching float leaves (0.0 when equal), for metrics.

    Raises ParityError on a structure difference, where no element-wise error is defined.
    """
    differences = find_differences(actual, expected, rtol=0.0, atol=0.0)
    structural = [d for d in differences if d.kind == "structure"]
    if structural:
        raise ParityError(format_differences(structural))
    return max((d.max_abs_error for d in differences), default=0.0)


def format_differences(differences: list[Difference], *, msg: str | None = None, exact: bool = False) -> str:
    mode = "compared bit for bit" if exact else "beyond the tolerance"
    header = f"{len(differences)} difference(s) ({mode}); actual vs expected:"
    if len(differences) >= MAX_REPORTED_DIFFERENCES:
        header = f"at least {len(differences)} differences ({mode}), first ones shown; actual vs expected:"
    lines = ([msg] if msg else []) + [header] + [f"  {d}" for d in differences]
    return "\n".join(lines)


def _root_name(value: Any) -> str:
    kind = kind_of(value)
    return {"kjt": "kjt", "kt": "kt", "jt": "jt", "td": "td", "mapping": "state"}.get(kind, "value")
