"""Run one model and one deterministic per-rank dataloader through each training pipeline.

The runners are torchrec's own classes (TrainPipelineBase, TrainPipelineSparseDist,
TrainPipelineFusedSparseDist, TrainPipelineSemiSync) and a plain loop written here as the
reference. Each run records, per step, the prediction returned by the step and the loss the model
computed; at the end, the full embedding tables (assembled from every rank's shards), the dense
parameters, the fused optimizer state and the dense optimizer state.

``run_pipeline_on_rank`` is the function the rank pool runs; ``run_pipeline(pool, spec)`` calls it
on every rank and assembles one ``PipelineRun``. On a CPU-only machine the stream-based pipelines
run inside ``paritykit.harness.cpu_shim.stream_shim()``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from paritykit.checks.pipeline.models import DataSpec, ModelSpec, build_sharded, make_batches
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.cpu_shim import overlap_optimizer_with_lookup, stream_shim
from paritykit.harness.devices import rank_device
from paritykit.harness.shards import assemble, detached, local_pieces

# Name -> (torchrec class name or None for the plain loop, constructor keyword arguments).
PIPELINES: dict[str, tuple[str | None, dict[str, Any]]] = {
    "plain": (None, {}),
    "base": ("TrainPipelineBase", {}),
    "sparse_dist": ("TrainPipelineSparseDist", {}),
    "fused:data_dist": ("TrainPipelineFusedSparseDist", {"emb_lookup_stream": "data_dist"}),
    "fused:data_dist:after_dd": (
        "TrainPipelineFusedSparseDist",
        {"emb_lookup_stream": "data_dist", "embedding_lookup_after_data_dist": True},
    ),
    "fused:new": ("TrainPipelineFusedSparseDist", {"emb_lookup_stream": "new"}),
    "fused:new:after_dd": (
        "TrainPipelineFusedSparseDist",
        {"emb_lookup_stream": "new", "embedding_lookup_after_data_dist": True},
    ),
    "fused:current": ("TrainPipelineFusedSparseDist", {"emb_lookup_stream": "current"}),
    "fused:current:after_dd": (
        "TrainPipelineFusedSparseDist",
        {"emb_lookup_stream": "current", "embedding_lookup_after_data_dist": True},
    ),
    "semi_sync": ("TrainPipelineSemiSync", {"stash_gradients": False}),
}
FUSED_PIPELINES = tuple(name for name, (cls, _) in PIPELINES.items() if cls == "TrainPipelineFusedSparseDist")
# Pipelines that promise the plain loop's numbers exactly.
EXACT_PIPELINES = ("base", "sparse_dist") + FUSED_PIPELINES

# A pipeline that keeps returning steps past the data it was given is broken; stop it here.
EXTRA_STEPS_ALLOWED = 3


@dataclass(frozen=True)
class RunSpec:
    """One pipeline run: model, data, pipeline name and its options. Picklable."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    pipeline: str = "plain"
    device: str = "cpu"
    # TrainPipelineSemiSync: the first batch index that runs semi-synchronously.
    semi_sync_start_batch: int = 0
    # Fused pipelines on CPU: make each lookup see optimizer-updated parameters as they were before
    # the last optimizer step (stream_shim.overlap_optimizer_with_lookup).
    overlap_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {self.pipeline!r}; known: {', '.join(PIPELINES)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunSpec.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.overlap_optimizer and self.pipeline not in FUSED_PIPELINES:
            raise ValueError("overlap_optimizer only applies to the fused pipelines")

    def with_pipeline(self, pipeline: str) -> "RunSpec":
        return replace(self, pipeline=pipeline, overlap_optimizer=self.overlap_optimizer and pipeline in FUSED_PIPELINES)


@dataclass
class PipelineRun:
    """Everything one pipeline produced, assembled over ranks.

    outputs[step]: predictions, shape (world_size, batch_size). losses[step]: shape (world_size,).
    labels[step]: shape (world_size, batch_size). tables / fused_state: full tensors keyed by name.
    dense / dense_state: rank 0's values of replicated tensors (replicas are checked to agree).
    """

    spec: RunSpec
    outputs: list[torch.Tensor]
    losses: list[torch.Tensor]
    labels: list[torch.Tensor]
    tables: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor]
    fused_state: dict[str, torch.Tensor]
    dense_state: dict[str, torch.Tensor]

    @property
    def steps(self) -> int:
        return len(self.outputs)


# ---------------------------------------------------------------------------------------------
# On each rank


def run_pipeline_on_rank(spec: RunSpec) -> dict[str, Any]:
    """Build the model, train it through ``spec.pipeline`` on this rank's batches, record everything."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise HarnessError("run_pipeline_on_rank needs an initialised process group (run it through a RankPool)")
    device = rank_device(spec.device)
    model, optimizer = build_sharded(spec.model, device)
    batches = make_batches(spec.model, spec.data, dist.get_rank(), device)

    losses: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _a, out: losses.append(out[0].detach().clone()))
    try:
        with stream_shim():
            outputs = _train(spec, model, optimizer, batches, device)
    finally:
        hook.remove()
    if len(losses) != len(outputs):
        raise ParityError(f"{spec.pipeline}: the model ran {len(losses)} forwards for {len(outputs)} steps")
    return {
        "outputs": [o.detach().clone() for o in outputs],
        "losses": losses,
        "labels": [b.label.detach().clone() for b in batches][: len(outputs)],
        "tables": detached(local_pieces(_sharded_only(model.state_dict()))),
        "dense": detached(local_pieces(_dense_parameters(model))),
        "fused_state": detached(local_pieces(_flat_state(model.fused_optimizer.state_dict()["state"]))),
        "dense_state": detached(local_pieces(_plain_tensors(_flat_state(optimizer.state_dict()["state"])))),
    }


def _train(spec: RunSpec, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[torch.Tensor]:
    if spec.pipeline == "plain":
        return _plain_loop(model, optimizer, batches)
    pipeline = make_pipeline(spec, model, optimizer, device)
    overlap = contextlib.nullcontext()
    if spec.overlap_optimizer:
        overlap = overlap_optimizer_with_lookup(pipeline)
    with overlap:
        return _progress_until_exhausted(pipeline, iter(batches), limit=len(batches) + EXTRA_STEPS_ALLOWED, name=spec.pipeline)


def plain_step(model: Any, optimizer: Any, batch: Any) -> torch.Tensor:
    """One step of the reference loop; returns the prediction. No loss.item(): it adds no sync of its own."""
    optimizer.zero_grad()
    loss, prediction = model(batch)
    loss.backward()
    optimizer.step()
    return prediction


def _plain_loop(model: Any, optimizer: Any, batches: list[Any]) -> list[torch.Tensor]:
    return [plain_step(model, optimizer, batch) for batch in batches]


def make_pipeline(spec: RunSpec, model: Any, optimizer: Any, device: torch.device) -> Any:
    """torchrec's own pipeline object for ``spec.pipeline`` (never the plain loop)."""
    from torchrec.distributed.train_pipeline import train_pipelines

    class_name, kwargs = PIPELINES[spec.pipeline]
    if class_name is None:
        raise ValueError("the plain loop is not a torchrec pipeline")
    kwargs = dict(kwargs)
    if class_name == "TrainPipelineSemiSync":
        kwargs["start_batch"] = spec.semi_sync_start_batch
    return getattr(train_pipelines, class_name)(model=model, optimizer=optimizer, device=device, **kwargs)


def _progress_until_exhausted(pipeline: Any, batches: Any, limit: int, name: str) -> list[torch.Tensor]:
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(batches))
        except StopIteration:
            return outputs
        if len(outputs) > limit:
            raise ParityError(f"{name}: still returning steps after {len(outputs)} progress() calls for fewer batches")


def _sharded_only(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return {key: value for key, value in state.items() if isinstance(value, ShardedTensor)}


def _dense_parameters(model: Any) -> dict[str, torch.Tensor]:
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return dict(in_backward_optimizer_filter(model.named_parameters()))


def _flat_state(state: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for param, entries in state.items():
        for key, value in entries.items():
            flat[f"{param}/{key}"] = value
    return flat


def _plain_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


# ---------------------------------------------------------------------------------------------
# In the caller


def run_pipeline(pool: Any, spec: RunSpec) -> PipelineRun:
    """Run ``spec`` on every rank of ``pool`` and assemble the per-rank records into one PipelineRun."""
    records = pool.call(run_pipeline_on_rank, (spec,), case=f"pipeline {spec.pipeline}")
    return assemble_run(spec, records)


def assemble_run(spec: RunSpec, records: list[dict[str, Any]]) -> PipelineRun:
    steps = {len(r["outputs"]) for r in records}
    if len(steps) != 1:
        raise ParityError(f"{spec.pipeline}: ranks ran different numbers of steps: {[len(r['outputs']) for r in records]}")
    (n,) = steps
    return PipelineRun(
        spec=spec,
        outputs=[torch.stack([r["outputs"][i] for r in records]) for i in range(n)],
        losses=[torch.stack([r["losses"][i] for r in records]) for i in range(n)],
        labels=[torch.stack([r["labels"][i] for r in records]) for i in range(n)],
        tables=assemble([r["tables"] for r in records], f"{spec.pipeline}: tables"),
        dense=assemble([r["dense"] for r in records], f"{spec.pipeline}: dense parameters"),
        fused_state=assemble([r["fused_state"] for r in records], f"{spec.pipeline}: fused optimizer state"),
        dense_state=assemble([r["dense_state"] for r in records], f"{spec.pipeline}: dense optimizer state"),
    )
