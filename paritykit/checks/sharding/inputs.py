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
            for rank, batch in enumerate(per_rank):
                for path, kjt in sparse_inputs(batch):
                    validate_kjt(kjt, f"step {step}, rank {rank}, {path}", bounds)
    return world_size
