"""Gradient accumulation: torchrec's ``GradientAccumulationWrapper`` around a pipeline, and the plain
loop it must reproduce.

The wrapper lets the pipeline call ``zero_grad()`` and ``step()`` on the dense optimizer only at the
edges of a window of ``num_steps`` micro-batches, and keeps DDP from all-reducing inside a window
(``no_sync``); fused tables still train in every backward (fused TBE). What it promises is the plain
loop that accumulates: zero the dense gradients when a window starts, forward and backward every
micro-batch, step the dense optimizer when a window ends and when the data ends inside one. That
loop is ``AccumulationDrive("plain", ...)``, written here and sharing nothing with the wrapper.

The data may come in epochs: after each epoch the wrapper's ``reset()`` (which resets the pipeline
too) starts the next one on a fresh iterator, and the plain loop starts a fresh window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.engine.pipeline_contract import prediction_of, split_output
from paritykit.engine.pipeline_runs import make_torchrec_pipeline
from paritykit.errors import ParityError

PLAIN = "plain"
# A wrapped pipeline that keeps returning steps past its data is broken: stop it here.
EXTRA_STEPS_ALLOWED = 3


@dataclass(frozen=True)
class AccumulationDrive:
    """A driver (``pipeline_runs.record_on_rank``): ``pipeline`` wrapped for ``num_steps``-step gradient
    accumulation, or the plain accumulating loop. ``mark_last`` passes ``is_last_batch=True`` with each
    epoch's last batch (otherwise the wrapper learns of the end from StopIteration)."""

    pipeline: str
    num_steps: int
    epochs: tuple[int, ...] = ()  # batches per epoch; () means one epoch of every batch
    mark_last: bool = True

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")

    def epochs_of(self, batches: list[Any]) -> list[list[Any]]:
        sizes = self.epochs or (len(batches),)
        if sum(sizes) != len(batches):
            raise ValueError(f"epochs {sizes} do not add up to the {len(batches)} batches")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [batches[start:start + size] for start, size in zip(starts, sizes)]

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        if self.pipeline == PLAIN:
            return [out for epoch in self.epochs_of(batches) for out in accumulate_plainly(model, optimizer, epoch, self.num_steps)]
        from torchrec.distributed.train_pipeline.gradient_accumulation import (
            GradientAccumulationConfig,
            GradientAccumulationWrapper,
        )

        pipeline = make_torchrec_pipeline(self.pipeline, model, optimizer, device)
        wrapped = GradientAccumulationWrapper(pipeline, optimizer, model, GradientAccumulationConfig(num_steps=self.num_steps))
        outputs: list[Any] = []
        for epoch in self.epochs_of(batches):
            outputs += self._epoch(wrapped, epoch)
            wrapped.reset()
            if wrapped.current_step != 0:
                raise ParityError(f"GradientAccumulationWrapper.reset() left the step counter at {wrapped.current_step}")
        return outputs

    def _epoch(self, wrapped: Any, batches: list[Any]) -> list[Any]:
        data, outputs = iter(batches), []
        while len(outputs) <= len(batches) + EXTRA_STEPS_ALLOWED:
            last = self.mark_last and len(outputs) == len(batches) - 1
            try:
                outputs.append(wrapped.progress(data, is_last_batch=last))
            except StopIteration:
                return outputs
        raise ParityError(f"{self.pipeline} under gradient accumulation: still returning steps after {len(outputs)} "
                          f"progress() calls for {len(batches)} batches")


def accumulate_plainly(model: Any, optimizer: Any, batches: list[Any], num_steps: int) -> list[Any]:
    """The oracle: dense gradients summed over each window of ``num_steps`` batches, one dense step
    per window (the last one may be short); the loss back-propagated as torchrec's pipelines do."""
    predictions = []
    for index, batch in enumerate(batches):
        if index % num_steps == 0:
            optimizer.zero_grad()
        loss, prediction = split_output(model(batch))
        torch.sum(loss, dim=0).backward()
        if (index + 1) % num_steps == 0 or index == len(batches) - 1:
            optimizer.step()
        predictions.append(prediction_of((loss, prediction)))
    return predictions
