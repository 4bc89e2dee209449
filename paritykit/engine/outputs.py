"""Running a model on one batch and keeping what it returned, on either side of a comparison."""

from __future__ import annotations

from typing import Any

import torch


def resolved(value: Any) -> Any:
    """The value behind a torchrec awaitable. A LazyAwaitable caches its result once the model used
    it (waiting twice would repeat the collective), so its cache is read first."""
    cached = getattr(value, "_result", None)
    if cached is not None:
        return cached
    if hasattr(value, "wait") and not isinstance(value, torch.Tensor):
        wait_async = getattr(type(value), "_wait_async", None)
        return wait_async(value) if wait_async is not None else value.wait()
    return value


def to_cpu(value: Any) -> Any:
    """A detached CPU copy of an output pytree (awaitables resolved)."""
    value = resolved(value)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    kind = type(value).__name__
    if kind == "KeyedTensor":
        return type(value)(keys=value.keys(), length_per_key=value.length_per_key(), values=to_cpu(value.values()),
                           key_dim=value.key_dim())
    if kind == "JaggedTensor":
        weights = value.weights_or_none()
        return type(value)(values=to_cpu(value.values()), lengths=to_cpu(value.lengths()),
                           weights=None if weights is None else to_cpu(weights))
    if kind == "KeyedJaggedTensor":
        return value.to(torch.device("cpu"))
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def to_device(batch: Any, device: torch.device) -> Any:
    return batch.to(device) if hasattr(batch, "to") else batch


def forward(model: torch.nn.Module, batch: Any) -> Any:
    """The model on one batch: a tuple is the forward's positional arguments, anything else the one argument."""
    output = model(*batch) if isinstance(batch, tuple) else model(batch)
    return resolved(output)
