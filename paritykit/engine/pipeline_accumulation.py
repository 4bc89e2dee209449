"""Gradient accumulation: torchrec's ``GradientAccumulationWrapper`` around a pipeline, and the plain
loop it must reproduce.

The wrapper lets the pipeline call ``zero_grad()`` and ``step()`` on the dense optimizer only at the
edges of a window of ``num_steps`` micro-batches, and keeps DDP from all-reducing inside a window
(``no_sync``); fused tables still train in every backward (fused TBE). What it promises is the plain
loop that accumulates: zero the dense gradients when a window starts, forward and backward every
micro-batch, step the dense optimizer when a window ends and when the data ends inside one. That
loop is ``AccumulationDrive("plain", ...)``, written here and sharing nothing with the wrapper.

The wrapper also promises when DDP all-reduces (``GradientAccumulationConfig``: "warmup steps where all
iterations sync", then once per window): ``expected_syncs`` is that schedule, written here; the drive
counts the all-reduces of each step with a DDP communication hook (torch's own ``allreduce_hook``
does the reduction) and holds the wrapper to it on every rank.

The data may come in epochs: after each epoch the wrapper's ``reset()`` (which resets the pipeline
too) starts the next one on a fresh iterator, and the plain loop starts a fresh window. The first
epoch may be abandoned inside a window (``abandon_after``: the loop stops calling ``progress()``, as
a user breaking out of it does, and resets): the window's gradients are dropped, never stepped, and
the batches the pipeline had fetched ahead are never trained; the plain loop trains the batches up
to there and steps the full windows only.
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
    warmup: int = 1  # GradientAccumulationConfig.num_warmup_steps (its default)
    abandon_after: int = 0  # the first epoch left after this many batches (0: every epoch run to its end)

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.abandon_after and (self.abandon_after % self.num_steps == 0 or not self.epochs
                                   or self.abandon_after >= self.epochs[0]):
            raise ValueError(f"abandon_after={self.abandon_after} must end the first epoch ({self.epochs[:1]} batches) "
                             f"inside a window of {self.num_steps}")

    def trained_of(self, epoch: int, batches: list[Any]) -> list[Any]:
        """The batches of an epoch the loop trains: all, or the abandoned epoch's first ones."""
        return batches[: self.abandon_after] if epoch == 0 and self.abandon_after else batches

    def epochs_of(self, batches: list[Any]) -> list[list[Any]]:
        sizes = self.epochs or (len(batches),)
        if sum(sizes) != len(batches):
            raise ValueError(f"epochs {sizes} do not add up to the {len(batches)} batches")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [batches[start:start + size] for start, size in zip(starts, sizes)]

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        if self.pipeline == PLAIN:
            return [out for index, epoch in enumerate(self.epochs_of(batches))
                    for out in accumulate_plainly(model, optimizer, self.trained_of(index, epoch), self.num_steps,
                                                  step_last_window=not (index == 0 and self.abandon_after))]
        from torchrec.distributed.train_pipeline.gradient_accumulation import (
            GradientAccumulationConfig,
            GradientAccumulationWrapper,
        )

        pipeline = make_torchrec_pipeline(self.pipeline, model, optimizer, device)
        config = GradientAccumulationConfig(num_steps=self.num_steps, **_warmup_option(GradientAccumulationConfig, self.warmup))
        wrapped = GradientAccumulationWrapper(pipeline, optimizer, model, config)
        reductions = _count_all_reduces(model)
        outputs: list[Any] = []
        for index, epoch in enumerate(self.epochs_of(batches)):
            synced: list[bool] = []
            trained = len(self.trained_of(index, epoch))
            outputs += self._epoch(wrapped, epoch, reductions, synced, trained)
            expected = expected_syncs(len(epoch), self.num_steps, self.warmup, self.mark_last)[:trained]
            if self.mark_last and synced != expected:
                raise ParityError(f"{self.pipeline} under gradient accumulation ({self.num_steps} steps, {self.warmup} warm-up): "
                                  f"DDP all-reduced at steps {[i for i, s in enumerate(synced) if s]}, "
                                  f"expected {[i for i, s in enumerate(expected) if s]}")
            wrapped.reset()
            if wrapped.current_step != 0:
                raise ParityError(f"GradientAccumulationWrapper.reset() left the step counter at {wrapped.current_step}")
        return outputs

    def _epoch(self, wrapped: Any, batches: list[Any], reductions: list[int], synced: list[bool], trained: int) -> list[Any]:
        data, outputs = iter(batches), []
        while len(outputs) <= len(batches) + EXTRA_STEPS_ALLOWED:
            if trained < len(batches) and len(outputs) == trained:
                return outputs  # abandoned: the loop stops calling progress()
            last = self.mark_last and len(outputs) == len(batches) - 1
            before = reductions[0]
            try:
                outputs.append(wrapped.progress(data, is_last_batch=last))
            except StopIteration:
                return outputs
            synced.append(reductions[0] > before)
        raise ParityError(f"{self.pipeline} under gradient accumulation: still returning steps after {len(outputs)} "
                          f"progress() calls for {len(batches)} batches")


def expected_syncs(count: int, num_steps: int, warmup: int, mark_last: bool) -> list[bool]:
    """Per step of an epoch of ``count`` batches: does DDP all-reduce? The first step and the warm-up
    steps always, then the last micro-batch of each window, and the epoch's last batch when marked."""
    return [step == 0 or step < warmup or (step + 1) % num_steps == 0 or (mark_last and step == count - 1)
            for step in range(count)]


def _warmup_option(config_class: type, warmup: int) -> dict[str, int]:
    """``num_warmup_steps`` where this torchrec's config has it (by feature); 1 (no warm-up) is its absence."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config_class)}
    if "num_warmup_steps" in fields:
        return {"num_warmup_steps": warmup}
    if warmup != 1:
        raise ValueError("this torchrec's GradientAccumulationConfig has no num_warmup_steps")
    return {}


def _count_all_reduces(model: Any) -> list[int]:
    """A one-element counter of DDP's all-reduces (torch's allreduce_hook as each DDP's communication hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    count = [0]

    def counting(state, bucket):  # type: ignore[no-untyped-def] - DDP refuses other annotations than its own
        count[0] += 1
        return allreduce_hook(state, bucket)

    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            module.register_comm_hook(None, counting)
    return count


def accumulate_plainly(model: Any, optimizer: Any, batches: list[Any], num_steps: int, step_last_window: bool = True) -> list[Any]:
    """The oracle: dense gradients summed over each window of ``num_steps`` batches, one dense step
    per window (the last one may be short, and is dropped unstepped unless ``step_last_window``); the
    loss back-propagated as torchrec's pipelines do."""
    predictions = []
    for index, batch in enumerate(batches):
        if index % num_steps == 0:
            optimizer.zero_grad()
        loss, prediction = split_output(model(batch))
        torch.sum(loss, dim=0).backward()
        if (index + 1) % num_steps == 0 or (step_last_window and index == len(batches) - 1):
            optimizer.step()
        predictions.append(prediction_of((loss, prediction)))
    return predictions
