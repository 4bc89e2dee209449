"""torchrec's results against the reference's, bit for bit, naming the op, the field and the element.

Every expectation raises ParityError at the first field that differs; tensors are compared with
paritykit.compare (``exact=True``: bit patterns), after their dtype and shape. Metadata that a
KJT reports about itself (stride, length_per_key, ...) is compared as Python values.
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.checks.sparse_ops.build import dtype_name, torch_dtype
from paritykit.checks.sparse_ops.reference import Array, RefJT, RefKJT, cumsum
from paritykit.compare import assert_close
from paritykit.errors import ParityError


def expect_array(actual: Any, expected: Array | None, where: str) -> None:
    """A tensor (or None where the reference has none): dtype (unless any), shape, then every element."""
    if expected is None or actual is None:
        if (expected is None) != (actual is None):
            shown = "None" if actual is None else f"a {type(actual).__name__}"
            raise ParityError(f"{where}: torchrec gives {shown} where the reference has {'none' if expected is None else 'a tensor'}")
        return
    if not isinstance(actual, torch.Tensor):
        raise ParityError(f"{where}: torchrec gives a {type(actual).__name__}, the reference a tensor")
    if expected.dtype is not None and actual.dtype != torch_dtype(expected.dtype):
        raise ParityError(f"{where}: dtype {dtype_name(actual.dtype)} where the reference has {expected.dtype}")
    if expected.dtype is None and actual.is_floating_point():
        raise ParityError(f"{where}: dtype {dtype_name(actual.dtype)} where the reference has an integer dtype")
    if tuple(actual.shape) != expected.shape:
        raise ParityError(f"{where}: shape {tuple(actual.shape)} where the reference has {expected.shape}")
    reference = torch.tensor(list(expected.flat), dtype=actual.dtype).reshape(expected.shape)
    assert_close(actual.detach().cpu(), reference, exact=True, name=where)


def expect_value(actual: Any, expected: Any, where: str) -> None:
    """A Python value (keys, strides, length_per_key, ...): equal, or ParityError showing both."""
    if actual != expected:
        raise ParityError(f"{where}: torchrec gives {actual!r}, the reference {expected!r}")


def ints(items: Any, dtype: str | None) -> Array:
    return Array((len(items),), tuple(items), dtype)


def expect_offsets(actual: Any, lengths: tuple[int, ...], where: str) -> None:
    """Offsets: the cumulative sum of the lengths, from 0. With no rows at all torchrec's own
    ``empty`` constructors and ``split``'s empty pieces hold an empty tensor, which means the same."""
    if not lengths and isinstance(actual, torch.Tensor) and actual.numel() == 0:
        expect_array(actual, ints((), None), where)
        return
    expect_array(actual, ints(cumsum(lengths), None), where)


def expect_jt(actual: Any, expected: RefJT, where: str) -> None:
    """values, lengths, offsets and weights of a JaggedTensor."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    if not isinstance(actual, JaggedTensor):
        raise ParityError(f"{where}: torchrec gives a {type(actual).__name__}, the reference a JaggedTensor")
    expect_array(actual.values(), expected.values_array(), f"{where}.values()")
    expect_array(actual.lengths(), ints(expected.lengths, expected.lengths_dtype), f"{where}.lengths()")
    expect_offsets(actual.offsets(), expected.lengths, f"{where}.offsets()")
    weights = None if expected.weights is None else Array((len(expected.weights),), expected.weights, expected.weight_dtype)
    expect_array(actual.weights_or_none(), weights, f"{where}.weights_or_none()")


def expect_kjt(actual: Any, expected: RefKJT, where: str, *, inverse: bool = True) -> None:
    """Keys, tensors, then the metadata the KJT reports (computed by torchrec where it was not given)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not isinstance(actual, KeyedJaggedTensor):
        raise ParityError(f"{where}: torchrec gives a {type(actual).__name__}, the reference a KeyedJaggedTensor")
    expect_value(actual.keys(), list(expected.keys), f"{where}.keys()")
    flat = expected.flat_values()
    expect_array(actual.values(), Array((len(flat),), flat, expected.value_dtype), f"{where}.values()")
    # A KJT without keys has no lengths to carry a dtype (split's empty pieces make them int32).
    lengths_dtype = expected.lengths_dtype if expected.keys else None
    expect_array(actual.lengths(), ints(expected.flat_lengths(), lengths_dtype), f"{where}.lengths()")
    expect_offsets(actual.offsets(), expected.flat_lengths(), f"{where}.offsets()")
    weights = expected.flat_weights()
    expect_array(actual.weights_or_none(), None if weights is None else Array((len(weights),), weights, expected.weight_dtype),
                 f"{where}.weights_or_none()")
    expect_value(actual.variable_stride_per_key(), expected.variable, f"{where}.variable_stride_per_key()")
    expect_value(actual.stride_per_key(), expected.stride_per_key(), f"{where}.stride_per_key()")
    expect_value(actual.stride_per_key_per_rank(), expected.stride_per_key_per_rank(), f"{where}.stride_per_key_per_rank()")
    expect_value(actual.stride(), expected.stride(), f"{where}.stride()")
    expect_value(actual.length_per_key(), expected.length_per_key(), f"{where}.length_per_key()")
    expect_value(actual.offset_per_key(), expected.offset_per_key(), f"{where}.offset_per_key()")
    expect_value(actual.lengths_offset_per_key(), cumsum(expected.stride_per_key()), f"{where}.lengths_offset_per_key()")
    if len(set(expected.keys)) == len(expected.keys):  # a key taken twice (permute) has no one index
        expect_value(actual.index_per_key(), {key: i for i, key in enumerate(expected.keys)}, f"{where}.index_per_key()")
    if inverse:
        expect_inverse(actual.inverse_indices_or_none(), expected, where)


def expect_inverse(actual: Any, expected: RefKJT, where: str) -> None:
    """The inverse indices a KJT carries (``actual``: its inverse_indices_or_none())."""
    if expected.inverse is None or actual is None:
        expect_value(actual is None, expected.inverse is None, f"{where}.inverse_indices_or_none() is None")
        return
    expect_value(list(actual[0]), list(expected.keys), f"{where}.inverse_indices()[0]")
    rows = expected.inverse
    expect_array(actual[1], Array((len(rows), len(rows[0]) if rows else 0), tuple(i for r in rows for i in r), "int64"),
                 f"{where}.inverse_indices()[1]")
