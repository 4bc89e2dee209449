"""Evaluation through torchrec's eval pipelines, and the eval forward they must reproduce.

torchrec's ``EvalPipelineSparseDist`` (its batches come from a ``DataLoadingThread``),
``EvalPipelineFusedSparseDist`` (lookup before or after the data dist, or one batch ahead) and
``TrainEvalHybridPipelineBase`` in eval mode run the model forward over every batch, pipelined, and
train nothing. ``EvalDrive`` runs one of them (or the plain eval loop: the model in eval mode under
``no_grad``) on a rank inside ``pipeline_runs.record_on_rank``; ``eval_reference`` is the oracle in the
caller: the *unsharded* model's eval forward on every rank's batch, its state untouched.

A dataloader can fail: ``FlakyBatches`` raises at one batch, either an error marked retriable
(``is_retryable``, which ``DataLoadingThread`` skips: that batch is never evaluated) or one that is
not (it must reach the caller of ``progress()``; the batches before it are evaluated).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from paritykit.engine.outputs import forward, to_cpu
from paritykit.engine.pipeline_catalog import EVAL, VARIANTS, build_variant
from paritykit.engine.pipeline_contract import model_loss, prediction_of
from paritykit.engine.probes import EmbeddingProbe
from paritykit.engine.training import TrainingRecord, TrainingSetup
from paritykit.errors import HarnessError, ParityError

PLAIN_EVAL = "plain:eval"
# EvalPipelineSparseDist holds the next batch in its queue and its thread prefetches one more.
PREFETCHED = 2
# How long a stopped data-loading thread may take to end (it ends at once when it works).
STOP_JOIN_TIMEOUT_S = 10.0
# A pipeline that returns this many outputs past its data is not stopping: give up.
EXTRA_STEPS_ALLOWED = 3


class FlakyBatchError(RuntimeError):
    """What ``FlakyBatches`` raises; ``is_retryable`` is how torchrec's DataLoadingThread tells a
    batch to skip from a failure to report."""

    def __init__(self, index: int, retryable: bool) -> None:
        super().__init__(f"paritykit's flaky dataloader failed at batch {index} ({'retriable' if retryable else 'not retriable'})")
        self.is_retryable = retryable


class FlakyBatches:
    """An iterator over ``batches`` that raises FlakyBatchError instead of yielding batch ``fail_at``."""

    def __init__(self, batches: list[Any], fail_at: int, retryable: bool) -> None:
        self._batches, self._fail_at, self._retryable, self._next = batches, fail_at, retryable, 0

    def __iter__(self) -> Iterator[Any]:
        return self

    @property
    def reads(self) -> int:
        """How many batches were asked for so far."""
        return self._next

    def __next__(self) -> Any:
        index = self._next
        if index >= len(self._batches):
            raise StopIteration
        self._next += 1
        if index == self._fail_at:
            raise FlakyBatchError(index, self._retryable)
        return self._batches[index]


@dataclass(frozen=True)
class EvalDrive:
    """A driver (``record_on_rank``): the model in eval mode through ``pipeline`` (or the plain eval
    loop), optionally over a dataloader that fails at batch ``fail_at``."""

    pipeline: str = PLAIN_EVAL
    fail_at: int | None = None
    retryable: bool = True

    def __post_init__(self) -> None:
        if self.pipeline != PLAIN_EVAL and VARIANTS.get(self.pipeline, None) is None:
            raise ValueError(f"unknown eval pipeline {self.pipeline!r}")
        if self.pipeline != PLAIN_EVAL and VARIANTS[self.pipeline].promise != EVAL:
            raise ValueError(f"{self.pipeline!r} is not an eval pipeline")

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        model.eval()
        data = iter(batches) if self.fail_at is None else FlakyBatches(batches, self.fail_at, self.retryable)
        if self.pipeline == PLAIN_EVAL:
            with torch.no_grad():
                return [prediction_of(model(batch)) for batch in _skipping_retriable(data)]
        pipeline = build_variant(self.pipeline, model, optimizer, device)
        try:
            return self._progress(pipeline, data, len(batches))
        finally:
            pipeline.reset()  # EvalPipelineSparseDist's stops its DataLoadingThread

    def _progress(self, pipeline: Any, data: Iterator[Any], count: int) -> list[Any]:
        outputs: list[Any] = []
        while len(outputs) <= count + EXTRA_STEPS_ALLOWED:
            try:
                outputs.append(pipeline.progress(data))
            except StopIteration:
                if self.fail_at is not None and not self.retryable:
                    raise ParityError(f"{self.pipeline}: the dataloader failed at batch {self.fail_at} (not retriable), "
                                      "and progress() ended with StopIteration instead of raising that error") from None
                return outputs
            except FlakyBatchError as exc:
                if exc.is_retryable:
                    raise ParityError(f"{self.pipeline}: a retriable dataloader error reached progress(): {exc}") from exc
                return outputs
        raise ParityError(f"{self.pipeline}: still returning outputs after {len(outputs)} progress() calls for {count} batches")


@dataclass(frozen=True)
class StoppedEvalDrive:
    """A driver: ``pipeline`` (EvalPipelineSparseDist, with its DataLoadingThread) evaluates
    ``stop_after`` batches, then ``reset()`` stops it mid-epoch. Its thread must end (join) and leave the
    rest of the dataloader to the caller: at most the batch it was prefetching is read after the last
    one handed out (``stop_after + PREFETCHED`` reads in all)."""

    stop_after: int
    pipeline: str = "eval:sparse_dist"
    timeout_s: float = STOP_JOIN_TIMEOUT_S
    # Also join() the pipeline's threads once stopped, as threading.Thread promises a caller may
    # (torchrec's DataLoadingThread cannot be joined: the known issue data-loading-thread-join).
    join: bool = False

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        import threading

        model.eval()
        data = FlakyBatches(batches, len(batches), retryable=True)  # never fails: counts the reads
        before = set(threading.enumerate())
        pipeline = build_variant(self.pipeline, model, optimizer, device)
        outputs = [pipeline.progress(data) for _ in range(self.stop_after)]
        pipeline.reset()
        started = [thread for thread in threading.enumerate() if thread not in before]
        alive = _still_running(started, self.timeout_s)
        if alive:
            raise ParityError(f"{self.pipeline}: reset() after {self.stop_after} batches left {alive} running "
                              f"({self.timeout_s} s after the stop), holding the dataloader")
        if data.reads > self.stop_after + PREFETCHED:
            raise ParityError(f"{self.pipeline}: stopped after {self.stop_after} batches, it read {data.reads} from "
                              f"the dataloader (at most {self.stop_after + PREFETCHED}: one queued, one prefetched)")
        if self.join:
            _join(started, self.timeout_s, self.pipeline)
        return outputs


def _join(threads: list[Any], timeout_s: float, pipeline: str) -> None:
    """``thread.join(timeout)`` of each ended thread the pipeline started: what any caller of a
    threading.Thread may do. Its failure is the thread class's defect, reported as a finding."""
    for thread in threads:
        try:
            thread.join(timeout_s)
        except TypeError as error:
            raise ParityError(f"{pipeline}: {type(thread).__name__}.join() of the stopped pipeline's thread raised "
                              f"TypeError: {error}") from None


def _still_running(threads: list[Any], timeout_s: float) -> list[str]:
    """The names of ``threads`` still running after ``timeout_s``. Not ``join()`` nor
    ``is_alive()``: torchrec's DataLoadingThread shadows ``Thread._stop`` with a bool, so both raise
    TypeError once it has ended (docs/pipeline.md); a thread leaves ``threading.enumerate()`` when it ends."""
    import threading
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        running = [thread for thread in threads if thread in threading.enumerate()]
        if not running or time.monotonic() > deadline:
            return [thread.name for thread in running]
        time.sleep(0.01)


def _skipping_retriable(data: Iterator[Any]) -> Iterator[Any]:
    """The plain loop's reading of a flaky dataloader: skip a retriable failure, stop at any other."""
    while True:
        try:
            yield next(data)
        except StopIteration:
            return
        except FlakyBatchError as exc:
            if not exc.is_retryable:
                return


def evaluated_steps(count: int, drive: EvalDrive) -> list[int]:
    """The batch indices ``drive`` is promised to evaluate out of ``count``."""
    if drive.fail_at is None or drive.fail_at >= count:
        return list(range(count))
    if drive.retryable:
        return [i for i in range(count) if i != drive.fail_at]
    return list(range(drive.fail_at))


def eval_reference(setup: TrainingSetup, steps: list[int]) -> TrainingRecord:
    """The unsharded model from the full state, in eval mode, on batches ``steps`` of every rank:
    predictions, losses and embedding outputs per step, and the untouched state."""
    if not setup.batches:
        raise HarnessError("eval_reference needs at least one step of batches")
    model = setup.model_fn()
    model.load_state_dict(setup.full_state)
    model.eval()
    probe = EmbeddingProbe({name: model.get_submodule(name) for name in setup.embedding_module_names})
    outputs, losses, embeddings = [], [], []
    with torch.no_grad():
        for step in steps:
            step_outputs, step_losses, step_embeddings = [], [], []
            for batch in setup.batches[step]:
                output = forward(model, batch)
                step_embeddings.append(probe.take())
                step_losses.append(model_loss(output).detach().clone())
                step_outputs.append(to_cpu(prediction_of(output)))
            outputs.append(step_outputs)
            losses.append(step_losses)
            embeddings.append(step_embeddings)
    probe.remove()
    return TrainingRecord(outputs=outputs, losses=losses, embeddings=embeddings,
                          state={key: value.detach().clone() for key, value in model.state_dict().items()})


def without_optimizer_state(record: TrainingRecord) -> TrainingRecord:
    """``record`` compared on what evaluation can touch: steps and the model state."""
    return replace(record, fused_state={}, dense_state={})
