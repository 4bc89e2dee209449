"""Comparing tensors: dense, complex, sharded (ShardedTensor/DTensor) and sharded against full."""

from __future__ import annotations

from typing import Any

import torch

from paritykit.compare.policy import DEFAULT_TOLERANCES, Difference, Policy
from paritykit.harness.shards import window


def is_sharded_tensor(value: Any) -> bool:
    return type(value).__name__ == "ShardedTensor" and hasattr(value, "local_shards")


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def compare_tensor(actual: torch.Tensor, expected: torch.Tensor, path: str, policy: Policy, out: list[Difference]) -> None:
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
    if policy.max_relative and e.is_floating_point():
        finite = e[torch.isfinite(e)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        tolerance = (tolerance[0], tolerance[1] + policy.max_relative * scale)
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


def compare_sharded(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
    shards_a = _local_shards_by_offset(actual)
    shards_e = _local_shards_by_offset(expected)
    if list(actual.size()) != list(expected.size()):
        out.append(Difference(path, "structure", f"global shape {tuple(actual.size())} vs {tuple(expected.size())}"))
        return
    if shards_a.keys() != shards_e.keys():
        out.append(Difference(path, "structure", f"local shard offsets {sorted(shards_a)} vs {sorted(shards_e)}"))
        return
    for offsets in sorted(shards_a):
        compare_tensor(shards_a[offsets], shards_e[offsets], f"{path}<shard@{list(offsets)}>", policy, out)


def _local_shards_by_offset(value: Any) -> dict[tuple[int, ...], torch.Tensor]:
    if is_dtensor(value):
        offsets = _dtensor_offsets(value)
        return {offsets: value.to_local()}
    return {tuple(shard.metadata.shard_offsets): shard.tensor for shard in value.local_shards()}


def _dtensor_offsets(value: Any) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(int(o) for o in offsets)


def compare_distributed_with_full(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
    """A sharded value against a full tensor: each local shard against its slice of the full tensor."""
    distributed_is_actual = is_sharded_tensor(actual) or is_dtensor(actual)
    distributed, full = (actual, expected) if distributed_is_actual else (expected, actual)
    if list(distributed.size()) != list(full.shape):
        out.append(Difference(path, "structure", f"global shape {tuple(distributed.size())} vs {tuple(full.shape)}"))
        return
    for offsets, local in sorted(_local_shards_by_offset(distributed).items()):
        region = window(full, offsets, local.shape)
        pair = (local, region) if distributed_is_actual else (region, local)
        compare_tensor(*pair, f"{path}<shard@{list(offsets)}>", policy, out)
