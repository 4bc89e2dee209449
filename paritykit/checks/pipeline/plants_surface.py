"""Planted bugs in the rest of torchrec's pipeline machinery, for the surface cases' negative controls
(``surface.py``): eval pipelines, gradient accumulation, StagedTrainPipeline, the in-place batch copy,
pipelined post-processing and input tracing, detach/attach, backward hooks and the data-loading
thread. Each wraps a torchrec function for the duration of the block only (``plants.py`` imports
this module so that the registry holds them).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "pipeline"


def _wrapping(original_to_planted: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[Any], Any]:
    return lambda original: functools.wraps(original)(original_to_planted(original))


@register("eval-skips-last-batch", check=CHECK)
@contextlib.contextmanager
def eval_skips_last_batch() -> Iterator[None]:
    """The eval pipelines stop once the dataloader is used up, leaving the last queued batch unevaluated."""
    from torchrec.distributed.train_pipeline import train_pipelines, utils

    def fused(original: Callable[..., Any]) -> Callable[..., Any]:
        def progress(self: Any, dataloader_iter: Any) -> Any:
            if self._dataloader_exhausted and len(self.batches) == 1:
                raise StopIteration
            return original(self, dataloader_iter)

        return progress

    def loader(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_next_batch(self: Any, none_throws: bool = False) -> Any:
            return original(self, none_throws=True)

        return get_next_batch

    with replaced(train_pipelines.EvalPipelineFusedSparseDist, "progress", _wrapping(fused)), \
            replaced(utils.DataLoadingThread, "get_next_batch", _wrapping(loader)):
        yield


@register("eval-pipeline-trains", check=CHECK)
@contextlib.contextmanager
def eval_pipeline_trains() -> Iterator[None]:
    """EvalPipelineSparseDist back-propagates its loss: fused tables update during evaluation."""
    from torchrec.distributed.train_pipeline import train_pipelines

    def backward(_module: Any, _args: Any, output: Any) -> None:
        if output[0].requires_grad:
            torch.sum(output[0]).backward()

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def progress(self: Any, dataloader_iter: Any) -> Any:
            handle = self._model.register_forward_hook(backward)
            try:
                return original(self, dataloader_iter)
            finally:
                handle.remove()

        return progress

    with replaced(train_pipelines.EvalPipelineSparseDist, "progress", _wrapping(planted)):
        yield


@register("gradient-accumulation-divides-twice", check=CHECK)
@contextlib.contextmanager
def gradient_accumulation_divides_twice() -> Iterator[None]:
    """GradientAccumulationWrapper divides the accumulated dense gradients by the window length before
    stepping, as if the loss had not been averaged already: the dense step shrinks num_steps-fold."""
    from torchrec.distributed.train_pipeline import gradient_accumulation

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self._should_step():
                with torch.no_grad():
                    for group in self._optimizer.param_groups:
                        for param in group["params"]:
                            if param.grad is not None:
                                param.grad.div_(self._config.num_steps)
            return original(self, *args, **kwargs)

        return step

    with replaced(gradient_accumulation._GAOptimizerWrapper, "step", _wrapping(planted)):
        yield


@register("staged-drops-stage-output", check=CHECK)
@contextlib.contextmanager
def staged_drops_stage_output() -> Iterator[None]:
    """StagedTrainPipeline hands each stage's input, not its output, to the next stage."""
    from torchrec.distributed.train_pipeline import train_pipelines

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def _run_with_event(self: Any, runnable: Any, event: Any, inputs: Any, stream: Any) -> Any:
            _output, new_event = original(self, runnable, event, inputs, stream)
            return inputs, new_event

        return _run_with_event

    with replaced(train_pipelines.StagedTrainPipeline, "_run_with_event", _wrapping(planted)):
        yield


@register("inplace-copy-reuses-previous-batch", check=CHECK)
@contextlib.contextmanager
def inplace_copy_reuses_previous_batch() -> Iterator[None]:
    """TrainPipelineSparseDist's in-place batch copy hands out the previous batch once (its buffer was
    not refilled): that batch trains twice, the next one never."""
    from torchrec.distributed.train_pipeline import train_pipelines

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def inplace_copy_batch_to_gpu(self: Any, dataloader_iter: Any) -> Any:
            batch, context = original(self, dataloader_iter)
            previous = self.__dict__.get("_planted_previous_batch")
            self.__dict__["_planted_previous_batch"] = batch
            if context is not None and context.index == 2 and batch is not None and previous is not None:
                return previous, context
            return batch, context

        return inplace_copy_batch_to_gpu

    with replaced(train_pipelines.TrainPipelineSparseDist, "inplace_copy_batch_to_gpu", _wrapping(planted)):
        yield


@register("postproc-result-from-previous-batch", check=CHECK)
@contextlib.contextmanager
def postproc_result_from_previous_batch() -> Iterator[None]:
    """A pipelined post-processing module caches the previous batch's result for the current batch's
    sparse data dist (its context was not advanced)."""
    from torchrec.distributed.train_pipeline import postproc

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            cached = self._fqn in self._context.postproc_fwd_results
            result = original(self, *args, **kwargs)
            if cached:
                return result
            previous = self.__dict__.get("_planted_previous_result")
            self.__dict__["_planted_previous_result"] = result
            if previous is None:
                return result
            self._context.postproc_fwd_results[self._fqn] = previous
            return previous

        return forward

    with replaced(postproc.PipelinedPostproc, "forward", _wrapping(planted)):
        yield


@register("getitem-index-off-by-one", check=CHECK)
@contextlib.contextmanager
def getitem_index_off_by_one() -> Iterator[None]:
    """The pipelines' input tracing reads ``batch.x[i]`` as ``batch.x[i - 1]``: a sharded module's
    sparse data dist gets another list entry than the model's forward names."""
    from torchrec.distributed.train_pipeline import tracing

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def process(self: Any, arg: Any) -> Any:
            if isinstance(self.item_index, int) and not isinstance(self.item_index, bool):
                return arg[self.item_index - 1]
            return original(self, arg)

        return process

    with replaced(tracing.GetItemArgInfoStep, "process", _wrapping(planted)):
        yield


@register("attach-drops-in-flight-batches", check=CHECK)
@contextlib.contextmanager
def attach_drops_in_flight_batches() -> Iterator[None]:
    """TrainPipelineSparseDist.attach() restarts the pipeline: batches in flight at detach() are lost."""
    from torchrec.distributed.train_pipeline import train_pipelines

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        def attach(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.batches.clear()
            self.contexts.clear()
            return original(self, *args, **kwargs)

        return attach

    with replaced(train_pipelines.TrainPipelineSparseDist, "attach", _wrapping(planted)):
        yield


@register("backward-work-off-the-graph", check=CHECK)
@contextlib.contextmanager
def backward_work_off_the_graph() -> Iterator[None]:
    """An activation-site backward hook is registered on a detached copy of the tensor it found, so its
    work never runs."""
    from torchrec.distributed.train_pipeline import backward_injection

    def planted(_original: Callable[..., Any]) -> Callable[..., Any]:
        def _register_activation_hook(site: Any, target: Any, hook_fn: Any) -> Any:
            def forward_hook(_module: Any, inputs: Any, kwargs: Any, output: Any) -> None:
                tensor = site.tensor_finder(inputs, kwargs, output)
                if tensor is not None:
                    tensor.detach().requires_grad_().register_hook(hook_fn)

            return target.register_forward_hook(forward_hook, with_kwargs=True)

        return _register_activation_hook

    with replaced(backward_injection, "_register_activation_hook", planted):
        yield


@register("data-loading-errors-skipped", check=CHECK)
@contextlib.contextmanager
def data_loading_errors_skipped() -> Iterator[None]:
    """DataLoadingThread skips every dataloader error as if it were retriable: a failed dataloader
    looks like a shorter one, and evaluation goes on."""
    from torchrec.distributed.train_pipeline import utils

    with replaced(utils, "_is_data_loading_retriable", lambda _original: lambda exception: True):
        yield


@register("pipeline-new-iterator-stays-exhausted", check=CHECK)
@contextlib.contextmanager
def pipeline_new_iterator_stays_exhausted() -> Iterator[None]:
    """TrainPipelineSparseDist keeps its "data exhausted" flag when handed a new iterator: the next
    epoch, started without reset(), trains nothing."""
    from torchrec.distributed.train_pipeline import train_pipelines

    def planted(_original: Callable[..., Any]) -> Callable[..., Any]:
        def next_batch(self: Any, dataloader_iter: Any) -> Any:
            self._dataloader_iter = dataloader_iter  # the reset of _dataloader_exhausted forgotten
            if self._dataloader_exhausted:
                return None
            batch = next(dataloader_iter, None)
            self._dataloader_exhausted = batch is None
            return batch

        return next_batch

    with replaced(train_pipelines.TrainPipelineSparseDist, "_next_batch", planted):
        yield
