"""The structural walk: which comparison applies to a value, and the torchrec/tensordict/container ones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from paritykit.compare.policy import MAX_REPORTED_DIFFERENCES, Difference, Policy
from paritykit.compare.tensors import (
    compare_distributed_with_full,
    compare_sharded,
    compare_tensor,
    is_dtensor,
    is_sharded_tensor,
)

def kind_of(value: Any) -> str:
    """Classify without importing torchrec/tensordict unless the value comes from them."""
    if isinstance(value, torch.Tensor):
        if is_sharded_tensor(value):
            return "sharded"
        if is_dtensor(value):
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
    if is_sharded_tensor(value):
        return "sharded"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return "scalar"


def walk(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
    if len(out) >= MAX_REPORTED_DIFFERENCES:
        return
    kind_a, kind_e = kind_of(actual), kind_of(expected)
    if {kind_a, kind_e} <= {"sharded", "dtensor", "tensor"} and "tensor" in {kind_a, kind_e} and kind_a != kind_e:
        compare_distributed_with_full(actual, expected, path, policy, out)
        return
    if kind_a != kind_e:
        out.append(Difference(path, "structure", f"type {type(actual).__name__} vs {type(expected).__name__}"))
        return
    walker = _WALKERS[kind_a]
    walker(actual, expected, path, policy, out)


def _compare_any_tensor(actual: torch.Tensor, expected: torch.Tensor, path: str, policy: Policy, out: list[Difference]) -> None:
    if actual.is_nested or expected.is_nested:
        _compare_nested(actual, expected, path, policy, out)
    else:
        compare_tensor(actual, expected, path, policy, out)


def _compare_nested(actual: torch.Tensor, expected: torch.Tensor, path: str, policy: Policy, out: list[Difference]) -> None:
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
        compare_tensor(actual.offsets().diff(), expected.offsets().diff(), f"{path}.lengths", policy, out)
        if len(out) and out[-1].path == f"{path}.lengths":
            out[-1] = Difference(out[-1].path, "structure", out[-1].detail)
            return
        compare_tensor(actual.values(), expected.values(), f"{path}.values", policy, out)
        return
    # Strided nested tensors: compare component by component.
    _compare_sequence(list(actual.unbind()), list(expected.unbind()), path, policy, out)


# ---------------------------------------------------------------- torchrec / tensordict structures


def _compare_jt(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
    n = len(out)
    compare_tensor(actual.lengths(), expected.lengths(), f"{path}.lengths", policy, out)
    if len(out) > n:
        out[-1] = Difference(out[-1].path, "structure", out[-1].detail)
        return
    compare_tensor(actual.values(), expected.values(), f"{path}.values", policy, out)
    _compare_optional(actual.weights_or_none(), expected.weights_or_none(), f"{path}.weights", policy, out)


def _compare_optional(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
    if (actual is None) != (expected is None):
        present = "present" if actual is not None else "absent"
        other = "present" if expected is not None else "absent"
        out.append(Difference(path, "structure", f"{present} vs {other}"))
    elif actual is not None:
        compare_tensor(actual, expected, path, policy, out)


def _compare_kjt(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
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
        compare_tensor(lengths_a[i], lengths_e[i], f"{key_path}.lengths", policy, out)
        if len(out) > n:
            out[-1] = Difference(out[-1].path, "structure", out[-1].detail)
            continue
        compare_tensor(values_a[i], values_e[i], f"{key_path}.values", policy, out)
        if weights_a is not None:
            compare_tensor(weights_a[i], weights_e[i], f"{key_path}.weights", policy, out)


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


def _compare_kt(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
    keys_a, keys_e = list(actual.keys()), list(expected.keys())
    if keys_a != keys_e:
        out.append(Difference(path, "structure", _key_detail(keys_a, keys_e)))
        return
    if list(actual.length_per_key()) != list(expected.length_per_key()):
        out.append(Difference(f"{path}.length_per_key", "structure", f"{actual.length_per_key()} vs {expected.length_per_key()}"))
        return
    dict_a, dict_e = actual.to_dict(), expected.to_dict()
    for key in keys_a:
        compare_tensor(dict_a[key], dict_e[key], f"{path}[{key!r}]", policy, out)


def _compare_td(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
    keys_a, keys_e = list(actual.keys()), list(expected.keys())
    if keys_a != keys_e:
        out.append(Difference(path, "structure", _key_detail(keys_a, keys_e)))
        return
    if tuple(actual.batch_size) != tuple(expected.batch_size):
        out.append(Difference(f"{path}.batch_size", "structure", f"{tuple(actual.batch_size)} vs {tuple(expected.batch_size)}"))
        return
    for key in keys_a:
        walk(actual.get(key), expected.get(key), f"{path}[{key!r}]", policy, out)


# ---------------------------------------------------------------- containers and scalars


def _compare_mapping(actual: Mapping, expected: Mapping, path: str, policy: Policy, out: list[Difference]) -> None:
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected]
    if missing or extra:
        out.append(Difference(path, "structure", f"keys differ: missing {missing}, unexpected {extra}"))
    for key in expected:
        if key in actual:
            walk(actual[key], expected[key], f"{path}[{key!r}]", policy, out)


def _compare_sequence(actual: Sequence, expected: Sequence, path: str, policy: Policy, out: list[Difference]) -> None:
    if len(actual) != len(expected):
        out.append(Difference(path, "structure", f"length {len(actual)} vs {len(expected)}"))
        return
    for i, (a, e) in enumerate(zip(actual, expected)):
        walk(a, e, f"{path}[{i}]", policy, out)


def _compare_scalar(actual: Any, expected: Any, path: str, policy: Policy, out: list[Difference]) -> None:
    if isinstance(actual, float) and isinstance(expected, float):
        compare_tensor(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), path, policy, out)
        return
    if type(actual) is not type(expected):
        out.append(Difference(path, "structure", f"type {type(actual).__name__} vs {type(expected).__name__}"))
    elif actual != expected:
        out.append(Difference(path, "value", f"{actual!r} vs {expected!r}"))


_WALKERS = {
    "tensor": _compare_any_tensor,
    "sharded": compare_sharded,
    "dtensor": compare_sharded,
    "jt": _compare_jt,
    "kjt": _compare_kjt,
    "kt": _compare_kt,
    "td": _compare_td,
    "mapping": _compare_mapping,
    "sequence": _compare_sequence,
    "scalar": _compare_scalar,
}
