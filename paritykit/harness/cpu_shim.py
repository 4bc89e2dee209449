"""A device-neutral stream shim that lets torchrec's own stream-based pipelines run on CPU.

TrainPipelineFusedSparseDist and TrainPipelineSemiSync (torchrec 1.8) are written against CUDA
streams. On a CPU build two things stop them, and nothing else:

1. ``Tensor.record_stream(torch.cpu.Stream)`` raises "unknown parameter type". The pipelines call it
   (directly and through ``KeyedJaggedTensor/KeyedTensor/ModelInput.record_stream`` and the module
   contexts) with ``torch.cpu.current_stream()``. The shim makes ``record_stream`` a no-op when the
   stream is a ``torch.cpu.Stream``; every other stream goes to the original method.
2. ``runtime_forwards.BaseForward`` picks ``torch.device("cuda")`` as its device when it is given no
   stream, and the pipelines give it none on CPU (their data-dist stream is None there). Its
   ``EmbeddingPipelinedForward.__call__`` then asks ``torch.cuda.current_stream()``. The shim sets
   that device to CPU for forwards constructed without a stream.

Why the numerics of the schedule are unchanged: ``record_stream`` only tells the CUDA caching
allocator that a block is still in use on another stream, so that its memory is not reused early;
it neither reads nor writes tensor values, and a CPU tensor has no stream-ordered allocator at all.
The device attribute of a forward only selects which module's ``current_stream()`` is used for the
same no-op waits and ``record_stream`` calls. Every CPU operation runs in program order on one
stream, so the pipeline computes exactly the sequence of operations its Python code issues: the
same calls, in the same order, on the same tensors, as on a GPU where every cross-stream wait is
honoured. (The cross-stream *races* a GPU may allow are a separate matter; see
``overlap_optimizer_with_lookup``.)

On a machine with CUDA, ``stream_shim()`` patches nothing: torchrec runs exactly as shipped.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from paritykit.harness.patching import patched, replaced


def shim_needed() -> bool:
    """True where torchrec's stream pipelines cannot run as shipped (no CUDA)."""
    return not torch.cuda.is_available()


def _record_stream_ignoring_cpu(original: Any) -> Any:
    @functools.wraps(original)
    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, torch.cpu.Stream):
            return None
        return original(self, stream)

    return record_stream


def _base_forward_init_on_cpu(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self._stream is None:
            self._device = torch.device("cpu")

    return __init__


@contextlib.contextmanager
def stream_shim(force: bool = False) -> Iterator[bool]:
    """Apply the two CPU patches for the duration of the block and restore them afterwards.

    Yields whether anything was patched. ``force=True`` patches even where CUDA exists (only
    useful to test the shim itself).
    """
    if not (force or shim_needed()):
        yield False
        return

    from torchrec.distributed.train_pipeline import runtime_forwards

    with replaced(torch.Tensor, "record_stream", _record_stream_ignoring_cpu), replaced(
        runtime_forwards.BaseForward, "__init__", _base_forward_init_on_cpu
    ):
        yield True


@contextlib.contextmanager
def overlap_optimizer_with_lookup(pipeline: Any) -> Iterator[None]:
    """Emulate on CPU the GPU interleaving in which the next embedding lookup overlaps the optimizer.

    TrainPipelineFusedSparseDist starts the lookup of batch i+1 on its emb_lookup stream without
    waiting for the optimizer step of batch i, which runs on the current stream. Its premise is that
    the lookup reads nothing the optimizer writes (fused TBE tables are updated in backward). On CPU
    program order always lets the optimizer finish first, which hides any violation of that premise.
    This context makes each lookup read the values that the optimizer-updated parameters of the
    pipelined (sharded) modules had *before* the latest ``optimizer.step()``, i.e. the worst case the
    GPU schedule permits. Parameters the optimizer does not update are untouched, so a model that
    satisfies the premise computes exactly what it computes without this context.

    It applies only where the lookup runs on a stream other than the current one; with
    ``emb_lookup_stream="current"`` the GPU orders the lookup after the optimizer and nothing changes.
    """
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineFusedSparseDist

    if not isinstance(pipeline, TrainPipelineFusedSparseDist):
        raise TypeError(f"overlap_optimizer_with_lookup needs a TrainPipelineFusedSparseDist, got {type(pipeline).__name__}")
    if _lookup_on_current_stream(pipeline):
        yield
        return

    optimizer = pipeline._optimizer
    original_step = optimizer.step
    original_lookup = pipeline.start_embedding_lookup
    before_step: dict[torch.nn.Parameter, torch.Tensor] = {}

    def optimizer_params() -> set[torch.nn.Parameter]:
        return {p for group in optimizer.param_groups for p in group["params"]}

    def exposed_params() -> list[torch.nn.Parameter]:
        updated = optimizer_params()
        return [p for module in pipeline._pipelined_modules for p in module.parameters() if p in updated]

    def step(*args: Any, **kwargs: Any) -> Any:
        before_step.clear()
        before_step.update({p: p.detach().clone() for p in exposed_params()})
        return original_step(*args, **kwargs)

    def start_embedding_lookup(*args: Any, **kwargs: Any) -> Any:
        # Swap storage with .data so that autograd sees no in-place write on the parameter.
        current = {p: p.data for p in before_step}
        for p, old in before_step.items():
            p.data = old
        try:
            return original_lookup(*args, **kwargs)
        finally:
            for p, value in current.items():
                p.data = value

    with patched(optimizer, "step", step), patched(pipeline, "start_embedding_lookup", start_embedding_lookup):
        yield


def _lookup_on_current_stream(pipeline: Any) -> bool:
    stream = pipeline._emb_lookup_stream
    if stream is None:
        return False
    if isinstance(stream, torch.cpu.Stream):
        return True
    return stream == torch.get_device_module(pipeline._device).current_stream()
