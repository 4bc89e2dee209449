"""torchrec's JaggedTensor, KeyedJaggedTensor and KeyedTensor built from a reference object.

Tensors are made with ``torch.tensor`` from the reference's Python lists (nothing computed by
torchrec or fbgemm); offsets are the reference's cumulative sums. The form (lengths, offsets or
both) and whether the KJT is handed its length_per_key/offset_per_key pick torchrec's code paths.
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.checks.sparse_ops.reference import Array, RefJT, RefKJT
from paritykit.checks.sparse_ops.reference_keyed import RefKT
from paritykit.errors import HarnessError

DTYPES = {
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise HarnessError(f"no torch dtype for {name!r}; known: {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype))


def tensor(array: Array, device: torch.device | str = "cpu", requires_grad: bool = False) -> torch.Tensor:
    """The tensor of a reference array (its dtype must be named)."""
    if array.dtype is None:
        raise HarnessError("a reference array without a dtype cannot be built into a tensor")
    out = torch.tensor(list(array.flat), dtype=torch_dtype(array.dtype), device=device).reshape(array.shape)
    return out.requires_grad_() if requires_grad else out


def flat_tensor(items: tuple | list, dtype: str, dim: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1-D tensor of numbers, or (n, dim) of rows."""
    if dim:
        return tensor(Array((len(items), dim), tuple(x for row in items for x in row), dtype), device)
    return torch.tensor(list(items), dtype=torch_dtype(dtype), device=device)


def _lengths_and_offsets(lengths: tuple[int, ...], offsets: list[int], dtype: str, form: str, device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "lengths" in form:
        out["lengths"] = torch.tensor(list(lengths), dtype=torch_dtype(dtype), device=device)
    if "offsets" in form:
        out["offsets"] = torch.tensor(offsets, dtype=torch_dtype(dtype), device=device)
    return out


def build_jt(ref: RefJT, form: str = "lengths", device: torch.device | str = "cpu", grad: bool = False) -> Any:
    """A JaggedTensor; with ``grad`` its float values and weights require gradients."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    values = flat_tensor(ref.values, ref.value_dtype, ref.dim, device)
    weights = None if ref.weights is None else flat_tensor(ref.weights, ref.weight_dtype or "float32", 0, device)
    if grad:
        values = values.requires_grad_() if values.is_floating_point() else values
        weights = None if weights is None else weights.requires_grad_()
    parts = _lengths_and_offsets(ref.lengths, ref.offsets(), ref.lengths_dtype or "int64", form, device)
    return JaggedTensor(values=values, weights=weights, **parts)


def build_kjt(ref: RefKJT, form: str = "lengths", metadata: bool = False, device: torch.device | str = "cpu",
              grad: bool = False) -> Any:
    """A KeyedJaggedTensor: a fixed batch (``stride``) or VBE (``stride_per_key_per_rank``, inverse indices)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    weights = None
    if ref.weights is not None:
        weights = flat_tensor(ref.flat_weights(), ref.weight_dtype or "float32", 0, device)
        weights = weights.requires_grad_() if grad else weights
    extra: dict[str, Any] = {}
    if metadata:
        extra = {"length_per_key": ref.length_per_key(), "offset_per_key": ref.offset_per_key()}
    if ref.variable:
        extra["stride_per_key_per_rank"] = [list(s) for s in ref.strides]
    else:
        extra["stride"] = ref.batch_size
    if ref.inverse is not None:
        extra["inverse_indices"] = (list(ref.keys), torch.tensor([list(r) for r in ref.inverse], dtype=torch.int64, device=device))
    parts = _lengths_and_offsets(ref.flat_lengths(), ref.offsets(), ref.lengths_dtype, form, device)
    values = flat_tensor(ref.flat_values(), ref.value_dtype, 0, device)
    return KeyedJaggedTensor(keys=list(ref.keys), values=values, weights=weights, **parts, **extra)


def build_kt(ref: RefKT, device: torch.device | str = "cpu", grad: bool = False) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedTensor

    values = tensor(ref.values_array(), device, requires_grad=grad)
    return KeyedTensor(keys=list(ref.keys), length_per_key=list(ref.dims), values=values, key_dim=ref.key_dim)
