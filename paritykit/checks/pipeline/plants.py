"""Planted bugs in torchrec's train pipelines and in what DMP shares with them, for the pipeline
check's negative controls.

The first four change what a torchrec pipeline class does (wrapping methods of the classes in
``torchrec.distributed.train_pipeline.train_pipelines``) while the plain loop stays untouched. The
last three are the kind the plain-loop comparison alone cannot see: a DMP bug that the plain loop
shares with every pipeline (the unsharded anchor catches it), a bug on the TensorDict input path
(TD runs against KJT runs catch it), and a SemiSync start-batch off-by-one (the exact prefix before
``start_batch`` catches it). Each is patched in for the duration of the block only.
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


# --- bugs the old comparison (each pipeline against a plain loop over the same DMP model and the
# same input) cannot see: DMP shares them with every pipeline, they sit on the TD input path that
# both sides took, or they need a SemiSync start batch above 0.


# Unannotated on purpose: DDP refuses a comm hook whose annotations are not GradBucket/Future.
def _sum_without_averaging(process_group, bucket):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


@register("dmp-ddp-sums-dense-gradients", check=CHECK)
@contextlib.contextmanager
def dmp_ddp_sums_dense_gradients() -> Iterator[None]:
    """DMP's data-parallel wrapper all-reduces dense gradients with a comm hook that sums them
    instead of averaging: on W ranks the dense layers learn W times faster, in the plain loop and
    every pipeline alike."""
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.distributed import model_parallel

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _ddp_wrap(self: Any, dmp: Any, env: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, dmp, env, device, *args, **kwargs)
            if isinstance(dmp._dmp_wrapped_module, DistributedDataParallel):
                dmp._dmp_wrapped_module.register_comm_hook(env.process_group, _sum_without_averaging)
            return result

        return _ddp_wrap

    with replaced(model_parallel.DefaultDataParallelWrapper, "_ddp_wrap", planted):
        yield


@register("semi-sync-starts-one-batch-early", check=CHECK)
@contextlib.contextmanager
def semi_sync_starts_one_batch_early() -> Iterator[None]:
    """TrainPipelineSemiSync.progress compares the batch index with start_batch - 1: the batch at
    start_batch is already looked up before the previous batch's backward (start_batch 0 hides it)."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def progress(self: Any, dataloader_iter: Any) -> Any:
            self._start_batch -= 1
            try:
                return original(self, dataloader_iter)
            finally:
                self._start_batch += 1

        return progress

    with _wrapped_progress(_pipeline_classes("TrainPipelineSemiSync"), wrap):
        yield


@register("td-input-dist-ignores-feature-order", check=CHECK)
@contextlib.contextmanager
def td_input_dist_ignores_feature_order() -> Iterator[None]:
    """A sharded EBC fed a TensorDict builds its KJT in the TensorDict's key order and skips the
    permutation into its sharding's feature order: once its input dist exists, features whose
    tables are placed out of table order are looked up in other features' tables."""
    from tensordict import TensorDictBase
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.sparse.tensor_dict import maybe_td_to_kjt

    def planted(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def input_dist(self: Any, ctx: Any, features: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(features, TensorDictBase):
                if len(self._features_order) > 0:
                    self._has_features_permute = False  # as torchrec does, but without reordering the keys
                features = maybe_td_to_kjt(features, list(features.keys()))
            return original(self, ctx, features, *args, **kwargs)

        return input_dist

    with replaced(ShardedEmbeddingBagCollection, "input_dist", planted):
        yield


# The surface cases' plants live in their own module; importing it registers them.
from paritykit.checks.pipeline import plants_surface  # noqa: E402,F401
from paritykit.checks.pipeline import plants_options  # noqa: E402,F401
