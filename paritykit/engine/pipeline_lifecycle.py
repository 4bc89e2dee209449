"""A pipeline's life beyond one pass over the data: detach, a step outside it, attach, reset, a new
iterator; and the hybrid pipeline switching between training and evaluation.

``LifecycleDrive`` splits a rank's batches into A (the first ``first``), one side batch and B (the
rest), and runs: A through the pipeline, but after ``detach_after`` steps ``detach()`` it, train one
plain step on the side batch with the model it returned, and ``attach()`` it again (the batches in
flight stay queued); once A is used up, ``detach()`` and ``attach()`` again (attaching after the end)
and ``reset()``; then B through the same pipeline, its first half on one iterator and the rest on a
new one without a reset (a training loop's next epoch: the pipeline must take the new data, not stay
exhausted), that iterator holding two more batches behind B that the pipeline fetches ahead; a
``reset()`` there, mid-epoch, must drop them untrained, and B's first half trains again on a fresh
iterator. The plain loop it must equal is the plain loop over ``lifecycle_order``: A[:detach_after],
side, A[detach_after:], B, B's first half. A pipeline without ``detach`` (TrainPipelineBase) resets
between A's first part (with the side batch last) and the rest, and before B's first half again.

``HybridDrive`` runs TrainEvalHybridPipelineBase over phases: trains on the first, evaluates the
second (``model.eval()``: forward only), trains on the third, each phase on its own iterator; its
plain counterpart does the same with zero_grad/forward/backward/step and a ``no_grad`` forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.engine.pipeline_contract import prediction_of, split_output
from paritykit.engine.pipeline_runs import make_torchrec_pipeline
from paritykit.errors import ParityError

PLAIN = "plain"
EXTRA_STEPS_ALLOWED = 3
# Batches left in the iterator behind the real ones when the pipeline is reset mid-epoch: more than a
# sparse-dist pipeline fetches ahead, so some are in flight at the reset.
FETCHED_AHEAD = 2


def lifecycle_order(count: int, first: int, detach_after: int, side_step: bool = True) -> list[int]:
    """The batch indices in the order the lifecycle trains them (see the module docstring)."""
    if not 0 < detach_after <= first < count:
        raise ValueError(f"need 0 < detach_after ({detach_after}) <= first ({first}) < batches ({count})")
    side = [first] if side_step else []
    again = list(range(first + 1, first + 1 + _first_half(count - first - 1)))
    return list(range(detach_after)) + side + list(range(detach_after, first)) + list(range(first + 1, count)) + again


def _first_half(count: int) -> int:
    return (count + 1) // 2


def progress_all(pipeline: Any, data: Any, count: int, label: str) -> list[Any]:
    """``progress()`` until StopIteration; ParityError if it keeps going past ``count`` batches."""
    outputs: list[Any] = []
    while len(outputs) <= count + EXTRA_STEPS_ALLOWED:
        try:
            outputs.append(pipeline.progress(data))
        except StopIteration:
            return outputs
    raise ParityError(f"{label}: still returning steps after {len(outputs)} progress() calls for {count} batches")


def progress_some(pipeline: Any, data: Any, count: int) -> list[Any]:
    """``count`` calls of ``progress()``, fewer where it stops early (the comparison sees the steps missing)."""
    outputs: list[Any] = []
    for _ in range(count):
        try:
            outputs.append(pipeline.progress(data))
        except StopIteration:
            break
    return outputs


def checked_reset(pipeline: Any, label: str) -> None:
    """``pipeline.reset()``, which resets its state: no batch and no batch context may stay in flight
    (where the pipeline keeps them in ``batches`` and ``contexts``). A context left behind is refilled by
    index and changes no number, so only its count shows it."""
    pipeline.reset()
    left = {name: len(getattr(pipeline, name)) for name in ("batches", "contexts") if hasattr(pipeline, name)}
    if any(left.values()):
        raise ParityError(f"{label}: reset() left " + ", ".join(f"{count} {name}" for name, count in left.items())
                          + " in flight")


def plain_step(model: Any, optimizer: Any, batch: Any) -> Any:
    optimizer.zero_grad()
    loss, prediction = split_output(model(batch))
    torch.sum(loss, dim=0).backward()
    optimizer.step()
    return prediction_of((loss, prediction))


@dataclass(frozen=True)
class LifecycleDrive:
    """A driver (``pipeline_runs.record_on_rank``): see the module docstring."""

    pipeline: str
    first: int
    detach_after: int
    # False: detach() and attach() back to back, the side batch never trained (lifecycle_order(side_step=False)).
    side_step: bool = True

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        lifecycle_order(len(batches), self.first, self.detach_after)
        part_a, side, part_b = batches[: self.first], batches[self.first], batches[self.first + 1:]
        pipeline = make_torchrec_pipeline(self.pipeline, model, optimizer, device)
        half = _first_half(len(part_b))
        if not hasattr(pipeline, "detach"):
            outputs = progress_all(pipeline, iter(part_a[: self.detach_after]), self.detach_after, self.pipeline)
            outputs.append(plain_step(model, optimizer, side))
            checked_reset(pipeline, self.pipeline)
            rest = part_a[self.detach_after:] + part_b
            outputs += progress_all(pipeline, iter(rest), len(rest), self.pipeline)
            checked_reset(pipeline, self.pipeline)
            return outputs + progress_all(pipeline, iter(part_b[:half]), half, f"{self.pipeline} (after a reset)")
        data = iter(part_a)
        outputs = [pipeline.progress(data) for _ in range(self.detach_after)]
        detached = pipeline.detach()
        if self.side_step:
            outputs.append(plain_step(detached, optimizer, side))
        pipeline.attach(detached)
        outputs += progress_all(pipeline, data, len(part_a), self.pipeline)
        pipeline.attach(pipeline.detach())  # attaching once the pipeline has run dry
        checked_reset(pipeline, self.pipeline)
        outputs += progress_all(pipeline, iter(part_b[:half]), half, self.pipeline)
        # The next epoch, without a reset; the side batch waits behind it, fetched ahead, never trained.
        data = iter(part_b[half:] + [side] * FETCHED_AHEAD)
        outputs += progress_some(pipeline, data, len(part_b) - half)
        checked_reset(pipeline, f"{self.pipeline} (mid-epoch)")
        return outputs + progress_all(pipeline, iter(part_b[:half]), half, f"{self.pipeline} (after a reset mid-epoch)")


@dataclass(frozen=True)
class HybridDrive:
    """A driver: TrainEvalHybridPipelineBase (or the plain loop) over (mode, batch count) phases."""

    phases: tuple[tuple[str, int], ...]
    pipeline: str = "hybrid"

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        if sum(count for _, count in self.phases) != len(batches):
            raise ValueError(f"phases {self.phases} do not cover the {len(batches)} batches")
        pipeline = None if self.pipeline == PLAIN else make_torchrec_pipeline(self.pipeline, model, optimizer, device)
        outputs: list[Any] = []
        start = 0
        for mode, count in self.phases:
            phase = batches[start:start + count]
            start += count
            model.train(mode == "train")
            if pipeline is not None:
                outputs += progress_all(pipeline, iter(phase), count, f"{self.pipeline} ({mode})")
            elif mode == "train":
                outputs += [plain_step(model, optimizer, batch) for batch in phase]
            else:
                with torch.no_grad():
                    outputs += [prediction_of(model(batch)) for batch in phase]
        model.train()
        return outputs
