"""Checking a user's sparse inputs before any rank runs, with errors that name the key and index.

torchrec itself reports a KJT whose lengths and values disagree as a raw ``split_with_sizes`` error
(or not at all, reading past the end), and an id outside its table as an index error deep inside a
kernel, on a rank. These checks read host metadata only (they run in the caller, before sharding).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError


def feature_bounds(model: nn.Module) -> dict[str, int]:
    """Feature -> the number of rows of the smallest table that reads it, over every embedding module."""
    from paritykit.harness.plan_resolution import embedding_modules

    bounds: dict[str, int] = {}
    for module in embedding_modules(model).values():
        for config in table_configs(module):
            for feature in config.feature_names:
                bounds[feature] = min(bounds.get(feature, config.num_embeddings), config.num_embeddings)
    return bounds


def table_configs(module: nn.Module) -> list[Any]:
    inner = getattr(module, "_embedding_bag_collection", module)
    for name in ("embedding_bag_configs", "embedding_configs"):
        if hasattr(inner, name):
            return list(getattr(inner, name)())
    return []


def sparse_inputs(batch: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """(path, KeyedJaggedTensor) for every KJT in a batch: itself, inside tuples, lists, dicts and the
    attributes of a batch object (torchrec's ModelInput keeps them as attributes)."""
    kind = type(batch).__name__
    if kind == "KeyedJaggedTensor":
        yield path, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from sparse_inputs(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from sparse_inputs(value, f"{path}[{index}]")
    elif hasattr(batch, "__dict__") and not isinstance(batch, (torch.Tensor, nn.Module)) and kind != "TensorDict":
        for name, value in vars(batch).items():
            yield from sparse_inputs(value, f"{path}.{name}")


def validate_kjt(kjt: Any, where: str, bounds: dict[str, int] | None = None) -> None:
    """HarnessError naming the key (and row or index) when a KJT's pieces disagree or an id is out of range."""
    keys = list(kjt.keys())
    lengths = kjt.lengths().detach().to("cpu")
    values = kjt.values().detach().to("cpu")
    strides = [sum(s) for s in kjt.stride_per_key_per_rank()] if kjt.variable_stride_per_key() else [kjt.stride()] * len(keys)
    if lengths.numel() != sum(strides):
        raise HarnessError(f"{where}: {len(keys)} keys with batch sizes {strides} need {sum(strides)} lengths; the KJT has {lengths.numel()}")
    if bool((lengths < 0).any()):
        raise HarnessError(f"{where}: negative length at position {int((lengths < 0).nonzero()[0])}")
    per_key = [int(chunk.sum()) for chunk in torch.split(lengths, strides)]
    if values.numel() != sum(per_key):
        detail = ", ".join(f"{k!r}: {n}" for k, n in zip(keys, per_key))
        raise HarnessError(f"{where}: the lengths sum to {sum(per_key)} ({detail}) but there are {values.numel()} values")
    weights = kjt.weights_or_none()
    if weights is not None and weights.numel() != values.numel():
        raise HarnessError(f"{where}: {weights.numel()} weights for {values.numel()} values")
    for key, chunk in zip(keys, torch.split(values, per_key)):
        limit = (bounds or {}).get(key)
        bad = ((chunk < 0) | (chunk >= limit)) if limit is not None else (chunk < 0)
        if bool(bad.any()):
            index = int(bad.nonzero()[0])
            raise HarnessError(
                f"{where}: feature {key!r} id {int(chunk[index])} at position {index} is outside its table"
                + (f" of {limit} rows" if limit is not None else "")
            )
