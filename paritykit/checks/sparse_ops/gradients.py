"""Gradients of the differentiable sparse ops against the vector-Jacobian product of the reference.

The ops only move numbers, so the reference's vjp is a scatter-add: run the reference op on
*tags* (each input element replaced by its name and flat position), which tells for every output
element the input element it came from (or none: padding); the gradient of an input element is
the sum of the upstream gradients at the output positions carrying its tag. Upstream gradients
are dyadic (values.dyadic_upstream), so those sums are exact in every dtype and torchrec's
gradients are compared bit for bit, whatever order autograd adds in.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import torch

from paritykit.checks.sparse_ops.build import torch_dtype
from paritykit.checks.sparse_ops.expect import expect_array
from paritykit.checks.sparse_ops.reference import Array, RefJT, RefKJT
from paritykit.checks.sparse_ops.reference_keyed import RefKT
from paritykit.checks.sparse_ops.values import MAX_SUMMED_TERMS, dyadic_upstream
from paritykit.errors import HarnessError, ParityError


def tag_jt(ref: RefJT, name: str) -> RefJT:
    """``ref`` with each value (row of a 2-D value: each number) and weight replaced by its tag."""
    if ref.dim:
        values = tuple(tuple((name, i * ref.dim + d) for d in range(ref.dim)) for i in range(len(ref.values)))
    else:
        values = tuple((name, i) for i in range(len(ref.values)))
    weights = None if ref.weights is None else tuple((f"{name}.weights", i) for i in range(len(ref.weights)))
    return replace(ref, values=values, weights=weights)


def tag_kjt(ref: RefKJT, name: str) -> RefKJT:
    def tags(per_key: tuple[tuple, ...], label: str) -> tuple[tuple, ...]:
        out, start = [], 0
        for items in per_key:
            out.append(tuple((label, start + i) for i in range(len(items))))
            start += len(items)
        return tuple(out)

    weights = None if ref.weights is None else tags(ref.weights, f"{name}.weights")
    return replace(ref, values=tags(ref.values, name), weights=weights)


def tag_kt(ref: RefKT, name: str) -> RefKT:
    width = len(ref.rows[0]) if ref.rows else 0
    return replace(ref, rows=tuple(tuple((name, r * width + c) for c in range(width)) for r in range(len(ref.rows))))


def reference_grad(outputs: list[tuple[Array, tuple[float, ...]]], name: str, size: int) -> tuple[float, ...]:
    """Sum of the upstream gradient at every output position tagged ``(name, i)``, for each i."""
    grad, terms = [0.0] * size, [0] * size
    for tags, upstream in outputs:
        for tag, g in zip(tags.flat, upstream):
            if tag is not None and tag[0] == name:
                grad[tag[1]] += g
                terms[tag[1]] += 1
    if max(terms, default=0) > MAX_SUMMED_TERMS:
        raise HarnessError(f"an element of {name!r} sums {max(terms)} upstream gradients; exact sums hold up to {MAX_SUMMED_TERMS}")
    return tuple(grad)


def expect_grads(outputs: list[tuple[Any, Array]], inputs: dict[str, torch.Tensor], where: str, seed: int) -> None:
    """Backpropagate dyadic upstream gradients through torchrec's ``outputs`` (each with the tags of
    the reference's output) and compare the gradient of every named input with the reference's."""
    rng = random.Random(seed)
    upstreams = [dyadic_upstream(rng, len(tags.flat)) for _, tags in outputs]
    tensors, grads = [], []
    for (actual, tags), upstream in zip(outputs, upstreams):
        if tuple(actual.shape) != tags.shape:
            raise ParityError(f"{where}: an output has shape {tuple(actual.shape)} where the reference has {tags.shape}")
        depends = any(tag is not None and tag[0] in inputs for tag in tags.flat)
        if depends and not actual.requires_grad:
            raise ParityError(f"{where}: an output of shape {tags.shape} does not require grad, though it is made of the inputs")
        if actual.requires_grad:
            tensors.append(actual)
            grads.append(torch.tensor(list(upstream), dtype=actual.dtype).reshape(tags.shape))
    if tensors:
        try:
            torch.autograd.backward(tensors, grads)
        except RuntimeError as exc:
            # The engine runs the ops' backward functions in C++, so the traceback ends here; the
            # upstream gradients were checked against the outputs' shapes above: the op's fault.
            raise ParityError(f"{where}: the backward of torchrec's op raised {type(exc).__name__}: {exc}") from exc
    for name, tensor in inputs.items():
        expected = reference_grad(list(zip([t for _, t in outputs], upstreams)), name, tensor.numel())
        actual = tensor.grad
        if actual is None and any(expected):
            raise ParityError(f"{where}: {name} got no gradient (None) where the reference's is non-zero")
        shown = torch.zeros_like(tensor) if actual is None else actual
        expect_array(shown, Array(tuple(tensor.shape), expected, _dtype_name(tensor.dtype)), f"{where}: gradient of {name}")


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name in ("float16", "float32", "float64") if torch_dtype(name) == dtype)
