"""Planted bugs in torchrec's train pipelines, for the pipeline check's negative controls.

Each plant changes what a torchrec pipeline class does for the duration of the block (wrapping
methods of the classes in ``torchrec.distributed.train_pipeline.train_pipelines``); the plain loop
that serves as the reference is untouched, so the pipeline check must see a difference.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "pipeline"


def _pipeline_classes(*names: str) -> list[type]:
    from torchrec.distributed.train_pipeline import train_pipelines

    return [getattr(train_pipelines, name) for name in names]


@contextlib.contextmanager
def _wrapped_progress(classes: list[type], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    # Only classes that define progress themselves are patched, so a subclass is not wrapped twice.
    with contextlib.ExitStack() as stack:
        for cls in classes:
            if "progress" in vars(cls):
                stack.enter_context(replaced(cls, "progress", lambda original: functools.wraps(original)(wrap(original))))
        yield


@register("skipped-zero-grad", check=CHECK)
@contextlib.contextmanager
def skipped_zero_grad() -> Iterator[None]:
    """The pipelines forget optimizer.zero_grad(): dense gradients accumulate across steps."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def progress(self: Any, dataloader_iter: Any) -> Any:
            self._optimizer.zero_grad = lambda *args, **kwargs: None
            try:
                return original(self, dataloader_iter)
            finally:
                del self._optimizer.zero_grad

        return progress

    classes = _pipeline_classes("TrainPipelineBase", "TrainPipelineSparseDist", "TrainPipelineFusedSparseDist", "TrainPipelineSemiSync")
    with _wrapped_progress(classes, wrap):
        yield


@register("dropped-last-batch", check=CHECK)
@contextlib.contextmanager
def dropped_last_batch() -> Iterator[None]:
    """Once the dataloader is exhausted, the last batch left in the pipeline is never trained on."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def progress(self: Any, dataloader_iter: Any) -> Any:
            if self._dataloader_exhausted and len(self.batches) == 1:
                raise StopIteration
            return original(self, dataloader_iter)

        return progress

    classes = _pipeline_classes("TrainPipelineSparseDist", "TrainPipelineFusedSparseDist", "TrainPipelineSemiSync")
    with _wrapped_progress(classes, wrap):
        yield


def _table_batched_modules(module: torch.nn.Module) -> list[Any]:
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    # Sharded modules keep their lookups in a plain list, so module.modules() does not reach them.
    found = []
    for sharded in module.modules():
        for lookup in getattr(sharded, "_lookups", []):
            found += [m for m in lookup.modules() if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]
    return found


def _weight_buffers(tbe: Any) -> list[torch.Tensor]:
    return [t for t in (tbe.weights_host, tbe.weights_dev) if t.numel() > 0]


@register("stale-embedding-lookup", check=CHECK)
@contextlib.contextmanager
def stale_embedding_lookup() -> Iterator[None]:
    """The early embedding lookup (fused and semi-sync pipelines) reads the tables as they were at
    the previous lookup, i.e. before the last fused backward updated them."""
    from torchrec.distributed.train_pipeline import train_pipelines

    previous: dict[int, list[torch.Tensor]] = {}

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def start_embedding_lookup(module: Any, *args: Any, **kwargs: Any) -> Any:
            buffers = [b for tbe in _table_batched_modules(module) for b in _weight_buffers(tbe)]
            current = [b.data for b in buffers]
            snapshot = [b.detach().clone() for b in buffers]
            stale = previous.get(id(module))
            previous[id(module)] = snapshot
            if stale is None:
                return original(module, *args, **kwargs)
            for buffer, old in zip(buffers, stale):
                buffer.data = old
            try:
                return original(module, *args, **kwargs)
            finally:
                for buffer, value in zip(buffers, current):
                    buffer.data = value

        return start_embedding_lookup

    with replaced(train_pipelines, "_start_embedding_lookup", planted):
        yield


@register("lost-optimizer-state", check=CHECK)
@contextlib.contextmanager
def lost_optimizer_state() -> Iterator[None]:
    """The fused pipeline resets the fused optimizer's state (e.g. Adagrad momentum) after each step."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def progress(self: Any, dataloader_iter: Any) -> Any:
            output = original(self, dataloader_iter)
            with torch.no_grad():
                for tbe in _table_batched_modules(self._model):
                    for states in tbe.split_optimizer_states():
                        for state in states:
                            state.zero_()
            return output

        return progress

    with _wrapped_progress(_pipeline_classes("TrainPipelineFusedSparseDist"), wrap):
        yield
