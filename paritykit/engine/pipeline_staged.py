"""torchrec's ``StagedTrainPipeline`` with ``SparseDataDistUtil`` stages, driven as its docstring shows.

The stages run ahead of the model: copy the batch to the device, a transform of the dense features
(a stand-in for a user's GPU post-processing stage; the plain loop applies the same function), then
torchrec's sparse data dist (and, with ``lookup_ahead``, the embedding lookup: semi-synchronous, the
lookup of batch i+1 precedes the backward of batch i). ``progress()`` returns the batch for the
training loop, which runs zero_grad, forward, backward and step itself; ``None`` when the data is
used up. ``flush_after`` asks the pipeline to flush (finish what is in flight, then refill) after
that many steps: the sequence of trained batches must not change. ``epochs`` splits the batches into
that many passes, each a new iterator handed to the same pipeline once the last one ran dry (a
training loop's epochs): the pipeline must take the new data, not stay exhausted. Between epochs the
drive calls ``flush_end()`` (the pipeline refills from the new iterator) unless ``refill_between_epochs``
is off: then the first ``progress()`` of the next epoch returns None while the pipeline refills, which
torchrec documents as "the iterator is depleted" (known issue ``staged-pipeline-next-epoch-returns-none``).
``detach_after`` detaches the model after that many steps (``SparseDataDistUtil.detach()``, batches
still in flight), trains it on one batch outside the pipeline (the first batch again), and goes on
with ``progress()``, which re-attaches it: torchrec documents that the in-flight batches are kept and
that the detached model trains like the one given to the pipeline.

The plain loop it is held to is ``StagedDrive(plain=True)``: the same transform, then zero_grad,
forward, backward and step on every batch in order.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from paritykit.engine.pipeline_contract import prediction_of, split_output
from paritykit.errors import HarnessError, ParityError

# What the dense-feature stage multiplies the float features by.
DENSE_SCALE = 0.5
EXTRA_STEPS_ALLOWED = 3


def scale_dense_features(batch: Any) -> Any:
    """The user stage: a new batch whose float features are scaled (its sparse features untouched)."""
    return dataclasses.replace(batch, float_features=batch.float_features * DENSE_SCALE)


def _to_device(batch: Any, device: torch.device) -> Any:
    from torchrec.distributed.train_pipeline.utils import get_h2d_func

    return get_h2d_func(batch, device)


def train_step(model: Any, optimizer: Any, batch: Any) -> Any:
    """One step of the training loop around a staged pipeline; returns the prediction."""
    optimizer.zero_grad()
    loss, prediction = split_output(model(batch))
    torch.sum(loss, dim=0).backward()
    optimizer.step()
    return prediction_of((loss, prediction))


@dataclass(frozen=True)
class StagedDrive:
    """A driver (``pipeline_runs.record_on_rank``) for StagedTrainPipeline, or its plain loop."""

    lookup_ahead: bool = False
    flush_after: int | None = None
    plain: bool = False
    epochs: int = 1
    refill_between_epochs: bool = True
    detach_after: int | None = None

    def __post_init__(self) -> None:
        if self.detach_after is not None and self.epochs != 1:
            raise HarnessError("StagedDrive: detach_after is defined for one epoch (the plain loop takes its extra step once)")

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        if self.plain:
            order = list(batches)
            if self.detach_after is not None:
                order.insert(self.detach_after, batches[0])
            return [train_step(model, optimizer, scale_dense_features(batch)) for batch in order]
        from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage, SparseDataDistUtil
        from torchrec.distributed.train_pipeline.train_pipelines import StagedTrainPipeline

        streams = torch.get_device_module(device)
        sdd = SparseDataDistUtil(model, data_dist_stream=streams.Stream(),
                                 embedding_lookup_stream=streams.Stream() if self.lookup_ahead else None)
        # torchrec's own debugging checks that each context advances with its batch. Not with the
        # lookup stage: _embedding_lookup_context asserts the lookup's results before it runs.
        sdd._WITH_CONTEXT_ASSERTIONS = not self.lookup_ahead
        stages = [
            PipelineStage("data_copy", functools.partial(_to_device, device=device), streams.Stream()),
            PipelineStage("scale_dense", scale_dense_features, streams.Stream()),
            sdd.start_sparse_data_dist_stage(),
        ] + ([sdd.start_embedding_lookup_stage()] if self.lookup_ahead else [])
        pipeline = StagedTrainPipeline(stages)
        cuts = [len(batches) * e // self.epochs for e in range(self.epochs + 1)]
        outputs: list[Any] = []
        try:
            for start, end in zip(cuts, cuts[1:]):
                if start and self.refill_between_epochs:
                    pipeline.flush_end()
                outputs += self._train(pipeline, model, optimizer, iter(batches[start:end]), end - start,
                                       lambda: self._detached_step(sdd, model, optimizer, batches[0], device))
        finally:
            sdd.detach()
        return outputs

    @staticmethod
    def _detached_step(sdd: Any, model: Any, optimizer: Any, batch: Any, device: torch.device) -> Any:
        sdd.detach()
        return train_step(model, optimizer, scale_dense_features(_to_device(batch, device)))

    def _train(self, pipeline: Any, model: Any, optimizer: Any, data: Any, count: int, detached_step: Any) -> list[Any]:
        outputs: list[Any] = []
        while len(outputs) <= count + EXTRA_STEPS_ALLOWED + (self.detach_after is not None):
            if self.flush_after is not None and len(outputs) == self.flush_after:
                pipeline.set_flush(True)
            if len(outputs) == self.detach_after:
                outputs.append(detached_step())
            batch = pipeline.progress(data)
            if batch is None:
                return outputs
            outputs.append(train_step(model, optimizer, batch))
        raise ParityError(f"StagedTrainPipeline: still returning batches after {len(outputs)} progress() calls for {count}")
