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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paritykit.errors import ParityError

# torch.testing.assert_close's defaults (rtol, atol) per dtype.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

# Stop collecting after this many differences: the first few locate the problem.
MAX_REPORTED_DIFFERENCES = 10


@dataclass(frozen=True)
class Difference:
    """One place where actual and expected disagree."""

    path: str
    kind: str  # "structure" or "value"
    detail: str
    max_abs_error: float = 0.0

    def __str__(self) -> str:
        return f"[{self.kind}] {self.path}: {self.detail}"


@dataclass(frozen=True)
class _Policy:
    rtol: float | None
    atol: float | None
    exact: bool


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    exact: bool = False,
    msg: str | None = None,
    name: str | None = None,
) -> None:
    """Raise ParityError listing where ``actual`` and ``expected`` differ; return None if they agree."""
    differences = find_differences(actual, expected, rtol=rtol, atol=atol, exact=exact, name=name)
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
) -> list[Difference]:
    """Every difference (up to MAX_REPORTED_DIFFERENCES), in walk order."""
    if (rtol is None) != (atol is None):
        raise ValueError("give both rtol and atol, or neither (then the per-dtype defaults apply)")
    out: list[Difference] = []
    _walk(actual, expected, name or _root_name(expected), _Policy(rtol, atol, exact), out)
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
    mode = "bit-exact" if exact else "within tolerance"
    header = f"{len(differences)} difference(s) ({mode}); actual vs expected:"
    if len(differences) >= MAX_REPORTED_DIFFERENCES:
        header = f"at least {len(differences)} differences ({mode}), first ones shown; actual vs expected:"
    lines = ([msg] if msg else []) + [header] + [f"  {d}" for d in differences]
    return "\n".join(lines)


def _root_name(value: Any) -> str:
    kind = _kind(value)
    return {"kjt": "kjt", "kt": "kt", "jt": "jt", "td": "td", "mapping": "state"}.get(kind, "value")


def _kind(value: Any) -> str:
    """Classify without importing torchrec/tensordict unless the value comes from them."""
    if isinstance(value, torch.Tensor):
        if _is_sharded_tensor(value):
            return "sharded"
        if _is_dtensor(value):
            return "dtensor"
        return "tensor"
    module = type(value).__module__ or ""
    cls = type(value).__name__
    if module.startswith("torchrec"):
        if cls == "KeyedJaggedTensor":
            return "kjt"
        if cls == "KeyedTensor":
            return "kt"
        if cls == "JaggedTensor":
            return "jt"
    if module.startswith("tensordict") and hasattr(value, "batch_size") and hasattr(value, "keys"):
        return "td"
    if _is_sharded_tensor(value):
        return "sharded"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return "scalar"


def _is_sharded_tensor(value: Any) -> bool:
    return type(value).__name__ == "ShardedTensor" and hasattr(value, "local_shards")


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def _walk(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    if len(out) >= MAX_REPORTED_DIFFERENCES:
        return
    kind_a, kind_e = _kind(actual), _kind(expected)
    if {kind_a, kind_e} <= {"sharded", "dtensor", "tensor"} and "tensor" in {kind_a, kind_e} and kind_a != kind_e:
        _compare_distributed_with_full(actual, expected, path, policy, out)
        return
    if kind_a != kind_e:
        out.append(Difference(path, "structure", f"type {type(actual).__name__} vs {type(expected).__name__}"))
        return
    walker = _WALKERS[kind_a]
    walker(actual, expected, path, policy, out)


# ---------------------------------------------------------------- tensors


def _compare_tensor(actual: torch.Tensor, expected: torch.Tensor, path: str, policy: _Policy, out: list[Difference]) -> None:
    if actual.is_nested or expected.is_nested:
        _compare_nested(actual, expected, path, policy, out)
        return
    if actual.dtype != expected.dtype:
        out.append(Difference(path, "structure", f"dtype {actual.dtype} vs {expected.dtype}"))
        return
    if actual.shape != expected.shape:
        out.append(Difference(path, "structure", f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}"))
        return
    tolerance = DEFAULT_TOLERANCES.get(actual.dtype, (0.0, 0.0)) if policy.rtol is None else (policy.rtol, policy.atol)
    a = _as_real(actual.detach().to("cpu"))
    e = _as_real(expected.detach().to("cpu"))
    if a.numel() == 0:
        return
    mismatch = _mismatch_mask(a, e, policy.exact, tolerance)
    count = int(mismatch.sum())
    if count == 0:
        return
    out.append(_value_difference(a, e, mismatch, count, path))


def _as_real(t: torch.Tensor) -> torch.Tensor:
    # Complex tensors are compared as (real, imag) pairs; the index gains a last dimension of 2.
    return torch.view_as_real(t) if t.is_complex() else t


def _mismatch_mask(a: torch.Tensor, e: torch.Tensor, exact: bool, tolerance: tuple[float, float]) -> torch.Tensor:
    if not a.is_floating_point():
        return a != e
    if exact:
        return _bits(a) != _bits(e)
    rtol, atol = tolerance
    a64, e64 = a.to(torch.float64), e.to(torch.float64)
    both_nan = torch.isnan(a64) & torch.isnan(e64)
    same_inf = torch.isinf(a64) & (a64 == e64)
    both_finite = torch.isfinite(a64) & torch.isfinite(e64)
    finite_close = both_finite & ((a64 - e64).abs() <= atol + rtol * e64.abs())
    return ~(both_nan | same_inf | finite_close)


def _bits(t: torch.Tensor) -> torch.Tensor:
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(by_size[t.element_size()])


def _value_difference(a: torch.Tensor, e: torch.Tensor, mismatch: torch.Tensor, count: int, path: str) -> Difference:
    first = _index(mismatch.nonzero()[0], a.dim())
    a_first, e_first = a[first].item() if a.dim() else a.item(), e[first].item() if e.dim() else e.item()
    detail = f"{count} of {a.numel()} elements differ; first at {path}{_fmt_index(first)}: {a_first!r} vs {e_first!r}"
    max_abs = 0.0
    if a.is_floating_point():
        diff = (a.to(torch.float64) - e.to(torch.float64)).abs()
        # Inf - Inf and NaN positions say nothing about magnitude; they are counted, not measured.
        finite = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
        max_abs = float(finite.max())
        rel = finite / e.to(torch.float64).abs().clamp_min(torch.finfo(torch.float64).tiny)
        worst = _index(torch.nonzero(finite == max_abs)[0], a.dim())
        detail += f"; max abs error {max_abs:.6g} at {path}{_fmt_index(worst)}, max rel error {float(rel.max()):.6g}"
        nan_a, nan_e = int(torch.isnan(a).sum()), int(torch.isnan(e).sum())
        if nan_a or nan_e:
            detail += f"; NaNs: actual {nan_a}, expected {nan_e}"
    return Difference(path, "value", detail, max_abs)


def _index(coords: torch.Tensor, dim: int) -> tuple[int, ...]:
    return tuple(int(c) for c in coords) if dim else ()


def _fmt_index(index: tuple[int, ...]) -> str:
    return f"[{', '.join(str(i) for i in index)}]" if index else ""


def _compare_nested(actual: torch.Tensor, expected: torch.Tensor, path: str, policy: _Policy, out: list[Difference]) -> None:
    if actual.is_nested != expected.is_nested:
        out.append(Difference(path, "structure", f"nested {actual.is_nested} vs {expected.is_nested}"))
        return
    if actual.layout != expected.layout:
        out.append(Difference(path, "structure", f"nested layout {actual.layout} vs {expected.layout}"))
        return
    if actual.layout == torch.jagged:
        if actual.size(0) != expected.size(0):
            out.append(Difference(path, "structure", f"batch size {actual.size(0)} vs {expected.size(0)}"))
            return
        _compare_tensor(actual.offsets().diff(), expected.offsets().diff(), f"{path}.lengths", policy, out)
        if len(out) and out[-1].path == f"{path}.lengths":
            out[-1] = Difference(out[-1].path, "structure", out[-1].detail)
            return
        _compare_tensor(actual.values(), expected.values(), f"{path}.values", policy, out)
        return
    # Strided nested tensors: compare component by component.
    _compare_sequence(list(actual.unbind()), list(expected.unbind()), path, policy, out)


def _compare_sharded(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    shards_a = _local_shards_by_offset(actual)
    shards_e = _local_shards_by_offset(expected)
    if list(actual.size()) != list(expected.size()):
        out.append(Difference(path, "structure", f"global shape {tuple(actual.size())} vs {tuple(expected.size())}"))
        return
    if shards_a.keys() != shards_e.keys():
        out.append(Difference(path, "structure", f"local shard offsets {sorted(shards_a)} vs {sorted(shards_e)}"))
        return
    for offsets in sorted(shards_a):
        _compare_tensor(shards_a[offsets], shards_e[offsets], f"{path}<shard@{list(offsets)}>", policy, out)


def _local_shards_by_offset(value: Any) -> dict[tuple[int, ...], torch.Tensor]:
    if _is_dtensor(value):
        offsets = _dtensor_offsets(value)
        return {offsets: value.to_local()}
    return {tuple(shard.metadata.shard_offsets): shard.tensor for shard in value.local_shards()}


def _dtensor_offsets(value: Any) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(int(o) for o in offsets)


def _compare_distributed_with_full(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    """A sharded value against a full tensor: each local shard against its slice of the full tensor."""
    distributed, full, distributed_is_actual = (actual, expected, True) if _kind(actual) != "tensor" else (expected, actual, False)
    if list(distributed.size()) != list(full.shape):
        out.append(Difference(path, "structure", f"global shape {tuple(distributed.size())} vs {tuple(full.shape)}"))
        return
    for offsets, local in sorted(_local_shards_by_offset(distributed).items()):
        window = full[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]
        pair = (local, window) if distributed_is_actual else (window, local)
        _compare_tensor(*pair, f"{path}<shard@{list(offsets)}>", policy, out)


# ---------------------------------------------------------------- torchrec / tensordict structures


def _compare_jt(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    n = len(out)
    _compare_tensor(actual.lengths(), expected.lengths(), f"{path}.lengths", policy, out)
    if len(out) > n:
        out[-1] = Difference(out[-1].path, "structure", out[-1].detail)
        return
    _compare_tensor(actual.values(), expected.values(), f"{path}.values", policy, out)
    _compare_optional(actual.weights_or_none(), expected.weights_or_none(), f"{path}.weights", policy, out)


def _compare_optional(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    if (actual is None) != (expected is None):
        present = "present" if actual is not None else "absent"
        other = "present" if expected is not None else "absent"
        out.append(Difference(path, "structure", f"{present} vs {other}"))
    elif actual is not None:
        _compare_tensor(actual, expected, path, policy, out)


def _compare_kjt(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    keys_a, keys_e = list(actual.keys()), list(expected.keys())
    if keys_a != keys_e:
        out.append(Difference(path, "structure", _key_detail(keys_a, keys_e)))
        return
    for side, value in (("actual", actual), ("expected", expected)):
        # A malformed KJT (values not matching its lengths) cannot be split per key.
        total = int(value.lengths().sum())
        if value.values().numel() != total:
            out.append(Difference(path, "structure", f"{side} KJT holds {value.values().numel()} values but its lengths sum to {total}"))
            return
    vbe_a, vbe_e = actual.variable_stride_per_key(), expected.variable_stride_per_key()
    if vbe_a != vbe_e:
        out.append(Difference(path, "structure", f"variable stride per key {vbe_a} vs {vbe_e}"))
        return
    if vbe_a:
        spk_a, spk_e = actual.stride_per_key_per_rank(), expected.stride_per_key_per_rank()
        if spk_a != spk_e:
            out.append(Difference(f"{path}.stride_per_key_per_rank", "structure", f"{spk_a} vs {spk_e}"))
            return
    elif actual.stride() != expected.stride():
        out.append(Difference(f"{path}.stride", "structure", f"{actual.stride()} vs {expected.stride()}"))
        return
    if (actual.weights_or_none() is None) != (expected.weights_or_none() is None):
        _compare_optional(actual.weights_or_none(), expected.weights_or_none(), f"{path}.weights", policy, out)
        return
    lengths_a, lengths_e = _split_by_key(actual, actual.lengths()), _split_by_key(expected, expected.lengths())
    values_a, values_e = _split_by_key(actual, actual.values(), by="values"), _split_by_key(expected, expected.values(), by="values")
    weights_a = _split_by_key(actual, actual.weights(), by="values") if actual.weights_or_none() is not None else None
    weights_e = _split_by_key(expected, expected.weights(), by="values") if expected.weights_or_none() is not None else None
    for i, key in enumerate(keys_a):
        key_path = f"{path}[{key!r}]"
        n = len(out)
        _compare_tensor(lengths_a[i], lengths_e[i], f"{key_path}.lengths", policy, out)
        if len(out) > n:
            out[-1] = Difference(out[-1].path, "structure", out[-1].detail)
            continue
        _compare_tensor(values_a[i], values_e[i], f"{key_path}.values", policy, out)
        if weights_a is not None:
            _compare_tensor(weights_a[i], weights_e[i], f"{key_path}.weights", policy, out)


def _split_by_key(kjt: Any, tensor: torch.Tensor, by: str = "lengths") -> list[torch.Tensor]:
    """Per-key slices of a KJT's lengths (by stride) or values/weights (by summed lengths), host-side."""
    if kjt.variable_stride_per_key():
        strides = [sum(s) for s in kjt.stride_per_key_per_rank()]
    else:
        strides = [kjt.stride()] * len(kjt.keys())
    lengths = kjt.lengths().detach().to("cpu")
    length_chunks = list(torch.split(lengths, strides))
    if by == "lengths":
        return list(torch.split(tensor, strides))
    sizes = [int(chunk.sum()) for chunk in length_chunks]
    return list(torch.split(tensor, sizes))


def _key_detail(keys_a: list, keys_e: list) -> str:
    missing = [k for k in keys_e if k not in keys_a]
    extra = [k for k in keys_a if k not in keys_e]
    if missing or extra:
        return f"keys differ: missing {missing}, unexpected {extra} (actual {keys_a} vs expected {keys_e})"
    return f"key order {keys_a} vs {keys_e}"


def _compare_kt(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    keys_a, keys_e = list(actual.keys()), list(expected.keys())
    if keys_a != keys_e:
        out.append(Difference(path, "structure", _key_detail(keys_a, keys_e)))
        return
    if list(actual.length_per_key()) != list(expected.length_per_key()):
        out.append(Difference(f"{path}.length_per_key", "structure", f"{actual.length_per_key()} vs {expected.length_per_key()}"))
        return
    dict_a, dict_e = actual.to_dict(), expected.to_dict()
    for key in keys_a:
        _compare_tensor(dict_a[key], dict_e[key], f"{path}[{key!r}]", policy, out)


def _compare_td(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    keys_a, keys_e = list(actual.keys()), list(expected.keys())
    if keys_a != keys_e:
        out.append(Difference(path, "structure", _key_detail(keys_a, keys_e)))
        return
    if tuple(actual.batch_size) != tuple(expected.batch_size):
        out.append(Difference(f"{path}.batch_size", "structure", f"{tuple(actual.batch_size)} vs {tuple(expected.batch_size)}"))
        return
    for key in keys_a:
        _walk(actual.get(key), expected.get(key), f"{path}[{key!r}]", policy, out)


# ---------------------------------------------------------------- containers and scalars


def _compare_mapping(actual: Mapping, expected: Mapping, path: str, policy: _Policy, out: list[Difference]) -> None:
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected]
    if missing or extra:
        out.append(Difference(path, "structure", f"keys differ: missing {missing}, unexpected {extra}"))
    for key in expected:
        if key in actual:
            _walk(actual[key], expected[key], f"{path}[{key!r}]", policy, out)


def _compare_sequence(actual: Sequence, expected: Sequence, path: str, policy: _Policy, out: list[Difference]) -> None:
    if len(actual) != len(expected):
        out.append(Difference(path, "structure", f"length {len(actual)} vs {len(expected)}"))
        return
    for i, (a, e) in enumerate(zip(actual, expected)):
        _walk(a, e, f"{path}[{i}]", policy, out)


def _compare_scalar(actual: Any, expected: Any, path: str, policy: _Policy, out: list[Difference]) -> None:
    if isinstance(actual, float) and isinstance(expected, float):
        _compare_tensor(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), path, policy, out)
        return
    if type(actual) is not type(expected):
        out.append(Difference(path, "structure", f"type {type(actual).__name__} vs {type(expected).__name__}"))
    elif actual != expected:
        out.append(Difference(path, "value", f"{actual!r} vs {expected!r}"))


_WALKERS = {
    "tensor": _compare_tensor,
    "sharded": _compare_sharded,
    "dtensor": _compare_sharded,
    "jt": _compare_jt,
    "kjt": _compare_kjt,
    "kt": _compare_kt,
    "td": _compare_td,
    "mapping": _compare_mapping,
    "sequence": _compare_sequence,
    "scalar": _compare_scalar,
}
