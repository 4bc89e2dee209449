"""The default loss of a training comparison: a fixed function of every floating output element.

Each floating leaf of the model's output (a tensor, a KeyedTensor's tensor per key, a JaggedTensor's
values, nested in dicts (by key), lists and tuples) is multiplied element-wise by a pseudo-random tensor that depends
only on the leaf's path and shape, and everything is summed. Every output element then carries its
own, nonzero, upstream gradient, so a moved or wrong element changes the gradients it feeds.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from paritykit.engine.outputs import resolved
from paritykit.harness.seeding import generator


def floating_leaves(output: Any, path: str = "output") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every floating tensor in ``output``, in a deterministic order."""
    output = resolved(output)
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield path, output
        return
    kind = type(output).__name__
    if kind == "KeyedTensor":
        # By key: a sharded EBC orders its keys by placement, so positions are not comparable.
        yield from floating_leaves(dict(output.to_dict()), path)
        return
    if kind == "JaggedTensor":
        yield from floating_leaves(output.values(), f"{path}.values")
        return
    if isinstance(output, dict):
        for key in sorted(output, key=str):
            yield from floating_leaves(output[key], f"{path}[{key!r}]")
        return
    if isinstance(output, (list, tuple)):
        for index, item in enumerate(output):
            yield from floating_leaves(item, f"{path}[{index}]")


def _weights(path: str, leaf: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(leaf.shape, generator=generator("loss", path, tuple(leaf.shape)), dtype=torch.float32)
    return weights.to(device=leaf.device, dtype=leaf.dtype)


def default_loss(output: Any, batch: Any = None) -> torch.Tensor:
    """sum over every floating output element of element * fixed pseudo-random weight."""
    total = None
    for path, leaf in floating_leaves(output):
        term = (leaf * _weights(path, leaf)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the model's output has no floating tensor to train on")
    return total


def loss_terms_magnitude(output: Any) -> float:
    """sum of |element * weight| over the terms ``default_loss`` adds: the size its roundoff is relative
    to (the terms cancel, so the sum can be far smaller than they are). 0.0 for an output without
    floating tensors."""
    return float(sum(float((leaf.detach().double() * _weights(path, leaf).double()).abs().sum())
                     for path, leaf in floating_leaves(output)))
