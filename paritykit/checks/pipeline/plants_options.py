"""Planted bugs for what a pipeline's options promise beyond its numbers (``engine/pipeline_promises.py``)
and for SemiSync when it never starts (the ``semi_sync:never_starts`` variant): each wraps torchrec for
the duration of the block only (``plants.py`` imports this module so that the registry holds them).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "pipeline"


def _wrapping(original_to_planted: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[Any], Any]:
    return lambda original: functools.wraps(original)(original_to_planted(original))


def _forcing(option: str, value: Any) -> Callable[[Any], Any]:
    """An ``__init__`` wrapper that builds the pipeline with ``option=value`` whatever the caller asked."""

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **{**kwargs, option: value})

        return __init__

    return _wrapping(planted)


@register("lite-frees-callers-batch", check=CHECK)
@contextlib.contextmanager
def lite_frees_callers_batch() -> Iterator[None]:
    """TrainPipelineSparseDistLite frees the batch's features after the input dist's permute though it
    was not asked to (free_features_storage_early on by default): on a CPU the caller's batch is emptied."""
    from torchrec.distributed.train_pipeline import train_pipelines

    with replaced(train_pipelines.TrainPipelineSparseDistLite, "__init__", _forcing("free_features_storage_early", True)):
        yield


@register("threaded-drops-apply-jit", check=CHECK)
@contextlib.contextmanager
def threaded_drops_apply_jit() -> Iterator[None]:
    """TrainPipelineSparseDistT does not hand ``apply_jit`` to its base class: nothing is scripted."""
    from torchrec.distributed.train_pipeline import experimental_pipelines

    with replaced(experimental_pipelines.TrainPipelineSparseDistT, "__init__", _forcing("apply_jit", False)):
        yield


@register("data-dist-inputs-never-cleared", check=CHECK)
@contextlib.contextmanager
def data_dist_inputs_never_cleared() -> Iterator[None]:
    """clear_data_dist_inputs=True, but the pipelines never free the in-flight all-to-alls' inputs."""
    from torchrec.distributed.train_pipeline import train_pipelines

    with replaced(train_pipelines.TrainPipelineSparseDist, "clear_sparse_data_dist_inputs",
                  lambda _original: lambda self, context: None):
        yield


@register("postproc-module-never-pipelined", check=CHECK)
@contextlib.contextmanager
def postproc_module_never_pipelined() -> Iterator[None]:
    """Input tracing refuses every post-processing module (as if it took no arguments): with
    ``pipeline_postproc=True`` the EBC behind it runs its input dist inside the forward."""
    from torchrec.distributed.train_pipeline import tracing

    with replaced(tracing.NodeArgsHelper, "_handle_module", lambda _original: lambda self, child_node, arg_info: None):
        yield


@register("postproc-left-in-the-model", check=CHECK)
@contextlib.contextmanager
def postproc_left_in_the_model() -> Iterator[None]:
    """Input tracing runs a post-processing module in the data-dist stage but never swaps it into the
    model (its fqn misspelt on the way down): the EBC behind it is pipelined and gets the right input,
    while the module itself runs a second time in every forward."""
    from torchrec.distributed.train_pipeline import tracing

    with replaced(tracing.NodeArgsHelper, "_swap_postproc_module_recursive",
                  lambda _original: lambda self, module, to_swap_module, postproc_module_fqn, path="": module):
        yield


@register("semi-sync-skips-last-lookup", check=CHECK)
@contextlib.contextmanager
def semi_sync_skips_last_lookup() -> Iterator[None]:
    """TrainPipelineSemiSync, before its start batch, does not look up the last batch left in its queue:
    that batch's forward finds no embeddings (or another batch's)."""
    from torchrec.distributed.train_pipeline import train_pipelines

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def start_embedding_lookup(self: Any, batch: Any, context: Any) -> Any:
            semi_sync = context.index is not None and context.index >= self._start_batch
            if self._dataloader_exhausted and len(self.batches) == 1 and not semi_sync:
                return None
            return original(self, batch, context)

        return start_embedding_lookup

    with replaced(train_pipelines.TrainPipelineSemiSync, "start_embedding_lookup", _wrapping(planted)):
        yield


@register("attach-binds-last-context", check=CHECK)
@contextlib.contextmanager
def attach_binds_last_context() -> Iterator[None]:
    """``attach()`` binds the pipelined modules to the newest batch's context instead of the next one's."""
    from torchrec.distributed.train_pipeline import train_pipelines

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def attach(self: Any, *args: Any, **kwargs: Any) -> Any:
            original(self, *args, **kwargs)
            if self.contexts:
                self._set_module_context(self.contexts[-1])

        return attach

    with replaced(train_pipelines.TrainPipelineSparseDist, "attach", _wrapping(planted)):
        yield


@register("semi-sync-refills-when-empty", check=CHECK)
@contextlib.contextmanager
def semi_sync_refills_when_empty() -> Iterator[None]:
    """TrainPipelineSemiSync does not take the next batch after each step; it refills its queue of three
    only once it is empty, so every third batch is looked up after the previous update (less stale
    than promised, inside the drift bounds)."""
    from torchrec.distributed.train_pipeline import train_pipelines

    cls = train_pipelines.TrainPipelineSemiSync

    def dequeue(original: Callable[..., Any]) -> Callable[..., Any]:
        def dequeue_batch(self: Any) -> Any:
            self._paritykit_skip_enqueue = True
            return original(self)

        return dequeue_batch

    def enqueue(original: Callable[..., Any]) -> Callable[..., Any]:
        def enqueue_batch(self: Any, dataloader_iter: Any) -> Any:
            if getattr(self, "_paritykit_skip_enqueue", False):
                self._paritykit_skip_enqueue = False
                return False
            return original(self, dataloader_iter)

        return enqueue_batch

    with replaced(cls, "dequeue_batch", _wrapping(dequeue)), replaced(cls, "enqueue_batch", _wrapping(enqueue)):
        yield


@register("data-loading-thread-ignores-stop", check=CHECK)
@contextlib.contextmanager
def data_loading_thread_ignores_stop() -> Iterator[None]:
    """DataLoadingThread.stop() wakes the thread without telling it to stop: it reads on from the
    dataloader and never ends."""
    from torchrec.distributed.train_pipeline import utils

    def planted(_original: Callable[..., Any]) -> Callable[..., Any]:
        def stop(self: Any) -> None:
            self._buffer_filled_event.set()
            self._buffer_empty_event.set()

        return stop

    with replaced(utils.DataLoadingThread, "stop", planted):
        yield


@register("gradient-accumulation-warmup-inverted", check=CHECK)
@contextlib.contextmanager
def gradient_accumulation_warmup_inverted() -> Iterator[None]:
    """GradientAccumulationWrapper syncs every step after the warm-up and only at window ends during it:
    the warm-up test inverted (the numbers move by roundoff only; the all-reduce schedule shows it)."""
    from torchrec.distributed.train_pipeline import gradient_accumulation

    def planted(_original: Callable[..., Any]) -> Callable[..., Any]:
        def _should_sync_grad(self: Any, is_last_batch: bool = False) -> bool:
            if is_last_batch or self.current_step == 0:
                return True
            if not self.current_step < self._config.num_warmup_steps:
                return True
            return (self.current_step + 1) % self._config.num_steps == 0

        return _should_sync_grad

    with replaced(gradient_accumulation.GradientAccumulationWrapper, "_should_sync_grad", planted):
        yield
