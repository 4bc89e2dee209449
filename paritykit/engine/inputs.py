"""The shape of ``batches[step][rank]`` and the sparse inputs inside, checked before any rank runs."""

from __future__ import annotations

from typing import Any

from torch import nn

from paritykit.errors import HarnessError
from paritykit.harness.inputs import feature_bounds, sparse_inputs, validate_kjt


def check_batches(steps: list[list[Any]], model: nn.Module | None = None) -> int:
    """The world size (ranks per step); HarnessError naming the step, rank and key at fault.

    With ``model``, every KJT inside every batch is also checked against the model's tables.
    """
    if not steps:
        raise HarnessError("batches is empty: give at least one step, batches[step][rank]")
    world_size = len(steps[0])
    if world_size < 1:
        raise HarnessError("batches[0] has no rank's batch: batches[step][rank] needs one batch per rank")
    for step, per_rank in enumerate(steps):
        if len(per_rank) != world_size:
            raise HarnessError(f"step {step} has {len(per_rank)} batches but step 0 has {world_size}: one per rank each step")
    if model is not None:
        bounds = feature_bounds(model)
        for step, per_rank in enumerate(steps):
            kinds: dict[str, tuple[int, tuple]] = {}
            for rank, batch in enumerate(per_rank):
                for path, kjt in sparse_inputs(batch):
                    validate_kjt(kjt, f"step {step}, rank {rank}, {path}", bounds)
                    _check_same_layout_on_every_rank(kinds, step, rank, path, kjt)
    return world_size


def _check_same_layout_on_every_rank(seen: dict[str, tuple[int, tuple]], step: int, rank: int, path: str, kjt) -> None:
    # The ranks exchange their KJTs' tensors in all-to-alls: different dtypes or keys across ranks crash
    # the collective (a segfault under gloo) instead of failing with a message.
    weights = kjt.weights_or_none()
    layout = (tuple(kjt.keys()), kjt.values().dtype, kjt.lengths().dtype, None if weights is None else weights.dtype)
    first = seen.setdefault(path, (rank, layout))
    if first[1] != layout:
        raise HarnessError(
            f"step {step}: {path} on rank {rank} has keys and dtypes (keys, values, lengths, weights) {layout}, "
            f"rank {first[0]} has {first[1]}: every rank must send the same layout"
        )
