"""One TrainingSetup through one of torchrec's training pipelines on every rank, recorded.

The runners are torchrec's own classes (TrainPipelineBase, TrainPipelineSparseDist,
TrainPipelineFusedSparseDist, TrainPipelineSemiSync, and the variants of ``pipeline_catalog``).
``record_on_rank`` shards the setup's model, lets a *driver* (a picklable callable: this module's
``PipelineDrive``, or the eval, staged, accumulation and lifecycle drivers of the other
``pipeline_*`` modules) train or evaluate it, and records what ran. The plain loop they are compared with is the
sharding engine's own (``paritykit.engine.training.train_on_rank``: zero_grad, forward,
the model's loss backward, step), and a pipeline run is recorded in the engine's ``TrainingRecord``
so that both compare field by field: per step and rank what ``progress()`` returned (the
prediction), the loss the model computed and what every embedding module returned (by key); after
the last step the state gathered from the shards, the fused and the dense optimizer state.

On a CPU-only machine the stream-based pipelines run inside ``paritykit.harness.cpu_shim.stream_shim()``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from paritykit.engine.pipeline_catalog import EXACT, SEMI_SYNC, VARIANTS, build_variant, promise_of
from paritykit.engine.pipeline_contract import model_loss
from paritykit.engine.builtin_models import DataSpec, ModelSpec
from paritykit.engine.pipeline_setup import sharded_for_training
from paritykit.engine.pipeline_promises import (
    BatchGuard,
    assert_inputs_freed,
    assert_pipelined,
    assert_scripted,
    declared_pipelined,
    recorded_all_to_all_inputs,
)
from paritykit.engine.outputs import to_cpu
from paritykit.engine.probes import EmbeddingProbe
from paritykit.engine.training import (
    TrainingRecord,
    TrainingSetup,
    _replicated_optimizer_state,
    assemble_records,
    train_on_rank,
)
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.cpu_shim import overlap_optimizer_with_lookup, stream_shim
from paritykit.harness.devices import rank_device
from paritykit.harness.dmp import fused_optimizer_pieces, state_pieces, submodules_by_name
from paritykit.harness.shards import detached, local_pieces

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


def pipeline_promise(name: str) -> str:
    """What the pipeline called ``name`` promises against a plain loop (pipeline_catalog's kinds)."""
    if name in VARIANTS:
        return promise_of(name)
    return EXACT if name in EXACT_PIPELINES else SEMI_SYNC
INPUT_TYPES = ("kjt", "td")

# A pipeline that keeps returning steps past the data it was given is broken; stop it here.
EXTRA_STEPS_ALLOWED = 3


@dataclass(frozen=True)
class RunSpec:
    """A built-in run: model, data, pipeline and its options. Picklable."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    pipeline: str = "plain"
    device: str = "cpu"
    # TrainPipelineSemiSync: the first batch index whose successor is looked up before its backward.
    semi_sync_start_batch: int = 0
    # Fused pipelines on CPU: make each lookup see optimizer-updated parameters as they were before
    # the last optimizer step (cpu_shim.overlap_optimizer_with_lookup).
    overlap_optimizer: bool = False
    # The pipelines' batches: KJTs, or the same data with the unweighted features as TensorDicts.
    input_type: str = "kjt"

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES and self.pipeline not in VARIANTS:
            raise ValueError(f"unknown pipeline {self.pipeline!r}; known: {', '.join([*PIPELINES, *VARIANTS])}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunSpec.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.overlap_optimizer and self.pipeline not in FUSED_PIPELINES:
            raise ValueError("overlap_optimizer only applies to the fused pipelines")
        if self.input_type not in INPUT_TYPES:
            raise ValueError(f"RunSpec.input_type must be one of {INPUT_TYPES}, got {self.input_type!r}")
        if self.semi_sync_start_batch < 0:
            raise ValueError(f"RunSpec.semi_sync_start_batch must be >= 0, got {self.semi_sync_start_batch}")

    def with_pipeline(self, pipeline: str) -> "RunSpec":
        return replace(self, pipeline=pipeline, overlap_optimizer=self.overlap_optimizer and pipeline in FUSED_PIPELINES)


@dataclass(frozen=True)
class PipelineJob:
    """One setup through one torchrec pipeline (never the plain loop). Picklable."""

    setup: TrainingSetup
    pipeline: str
    semi_sync_start_batch: int = 0
    overlap_optimizer: bool = False


# ---------------------------------------------------------------------------------------------
# On each rank


def train_through_pipeline(job: PipelineJob) -> dict[str, Any]:
    """Shard, train every batch through ``job.pipeline`` on this rank, record as train_on_rank does."""
    return record_on_rank(job.setup, PipelineDrive(job), job.pipeline)


@dataclass(frozen=True)
class PipelineDrive:
    """A driver: ``progress()`` until the pipeline raises StopIteration; its outputs."""

    job: PipelineJob

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        return _progress_until_exhausted(self.job, model, optimizer, batches, device)


def record_on_rank(setup: TrainingSetup, drive: Any, label: str) -> dict[str, Any]:
    """On a rank: shard ``setup``'s model, ``drive(model, optimizer, batches, device)``, and record per
    forward the loss and the embedding modules' outputs, the driver's outputs, and the final state."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise HarnessError("pipeline runs need an initialised process group (run them through a RankPool)")
    rank, device = dist.get_rank(), rank_device(setup.device)
    model, optimizer = sharded_for_training(setup, device)
    batches = [step[rank] for step in setup.batches]
    probe = EmbeddingProbe(submodules_by_name(model, setup.embedding_module_names))
    losses: list[torch.Tensor] = []
    embeddings: list[dict[str, Any]] = []

    def record_forward(_module: Any, args: Any, output: Any) -> None:
        losses.append(model_loss(output).detach().to("cpu").clone())
        embeddings.append(probe.take())

    hook = model.register_forward_hook(record_forward)
    try:
        with stream_shim(), torchrec_class_state_kept():
            outputs = drive(model, optimizer, batches, device)
    finally:
        hook.remove()
        probe.remove()
    if len(losses) != len(outputs):
        raise ParityError(f"{label}: the model ran {len(losses)} forwards for {len(outputs)} steps")
    return {
        "outputs": [to_cpu(output) for output in outputs],
        "losses": losses,
        "embeddings": embeddings,
        "probes": [],
        "state": state_pieces(model),
        "fused_state": fused_optimizer_pieces(model),
        # The same selection of dense optimizer state as the plain loop records.
        "dense_state": detached(local_pieces(_replicated_optimizer_state(model, optimizer.state_dict()["state"]))),
    }


@contextlib.contextmanager
def torchrec_class_state_kept() -> Any:
    """torchrec pipelines built with ``clear_data_dist_inputs`` set a class attribute of
    ``PipelinedForward`` for good; restore it so that a run cannot change the next one on this rank."""
    from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

    kept = PipelinedForward.__dict__.get("_use_main_stream_for_dist_init", False)
    try:
        yield
    finally:
        PipelinedForward._use_main_stream_for_dist_init = kept


def make_torchrec_pipeline(name: str, model: Any, optimizer: Any, device: torch.device, semi_sync_start_batch: int = 0) -> Any:
    """torchrec's own pipeline object for the pipeline called ``name`` (never the plain loop)."""
    from torchrec.distributed.train_pipeline import train_pipelines

    if name in VARIANTS:
        return build_variant(name, model, optimizer, device, semi_sync_start_batch)
    class_name, kwargs = PIPELINES[name]
    if class_name is None:
        raise ValueError("the plain loop is not a torchrec pipeline")
    kwargs = dict(kwargs)
    if class_name == "TrainPipelineSemiSync":
        kwargs["start_batch"] = semi_sync_start_batch
    return getattr(train_pipelines, class_name)(model=model, optimizer=optimizer, device=device, **kwargs)


def make_pipeline(spec: RunSpec, model: Any, optimizer: Any, device: torch.device) -> Any:
    """torchrec's pipeline object for a RunSpec (the sync budgets drive pipelines this way)."""
    return make_torchrec_pipeline(spec.pipeline, model, optimizer, device, spec.semi_sync_start_batch)


def plain_step(model: Any, optimizer: Any, batch: Any) -> Any:
    """One step of a plain loop; returns the prediction. No loss.item(): it adds no sync of its own."""
    optimizer.zero_grad()
    loss, prediction = model(batch)
    loss.backward()
    optimizer.step()
    return prediction


def _progress_until_exhausted(job: PipelineJob, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
    pipeline = make_torchrec_pipeline(job.pipeline, model, optimizer, device, job.semi_sync_start_batch)
    overlap = overlap_optimizer_with_lookup(pipeline) if job.overlap_optimizer else contextlib.nullcontext()
    options = options_of(job.pipeline)
    guard = None if options.get("free_features_storage_early") else BatchGuard(batches)
    remaining, outputs = iter(batches), []
    with overlap, recorded_all_to_all_inputs() as sent:
        while True:
            try:
                outputs.append(pipeline.progress(remaining))
            except StopIteration:
                break
            if len(outputs) == 1:
                _check_pipelined(job.pipeline, pipeline, model, options)
            if len(outputs) > len(batches) + EXTRA_STEPS_ALLOWED:
                raise ParityError(f"{job.pipeline}: still returning steps after {len(outputs)} progress() calls for {len(batches)} batches")
    _check_options_kept(job.pipeline, pipeline, model, options, guard, sent)
    return outputs


def options_of(name: str) -> dict[str, Any]:
    """The constructor options paritykit asked for (never torchrec's defaults: what an option promises
    is judged from what the caller asked)."""
    return dict(VARIANTS[name].options) if name in VARIANTS else dict(PIPELINES[name][1])


def _default_of(cls: type, option: str) -> Any:
    """``cls``'s default for ``option`` (the most derived class that names it)."""
    import inspect

    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        parameter = None if init is None else inspect.signature(init).parameters.get(option)
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    return False


def _check_pipelined(name: str, pipeline: Any, model: Any, options: dict[str, Any]) -> None:
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist

    postproc = options.get("pipeline_postproc", _default_of(type(pipeline), "pipeline_postproc"))
    expected = declared_pipelined(model, bool(postproc))
    if expected is not None and isinstance(pipeline, TrainPipelineSparseDist):
        assert_pipelined(model, expected, name)


def _check_options_kept(name: str, pipeline: Any, model: Any, options: dict[str, Any], guard: BatchGuard | None,
                        sent: list[Any]) -> None:
    """The promises of the options beyond the numbers (pipeline_promises.py)."""
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import train_pipelines

    if guard is not None:
        guard.assert_intact(name)
    assert_scripted(model, bool(options.get("apply_jit", False)), name)
    # Lite waits each input dist inside the progress() that starts it: no input stays in flight to free.
    lite = getattr(train_pipelines, "TrainPipelineSparseDistLite", ())
    if options.get("clear_data_dist_inputs") and dist.get_world_size() > 1 and not isinstance(pipeline, lite):
        assert_inputs_freed(sent, name)


# ---------------------------------------------------------------------------------------------
# In the caller


def run_plain(pool: Any, setup: TrainingSetup, label: str = "plain") -> TrainingRecord:
    """The sharding engine's plain loop over the DMP model, on every rank of ``pool``."""
    return assembled_run(pool.call(train_on_rank, (setup,), case=f"pipeline {label}"), label)


def run_pipeline(pool: Any, job: PipelineJob, label: str | None = None) -> TrainingRecord:
    """``job`` on every rank of ``pool``, assembled into one TrainingRecord."""
    label = label or job.pipeline
    return assembled_run(pool.call(train_through_pipeline, (job,), case=f"pipeline {label}"), label)


def run_driven(pool: Any, setup: TrainingSetup, drive: Any, label: str) -> TrainingRecord:
    """``drive`` (a picklable driver, see ``record_on_rank``) on every rank of ``pool``, assembled."""
    return assembled_run(pool.call(record_on_rank, (setup, drive, label), case=f"pipeline {label}"), label)


def assembled_run(per_rank: list[dict[str, Any]], label: str) -> TrainingRecord:
    steps = [len(record["outputs"]) for record in per_rank]
    if len(set(steps)) != 1:
        raise ParityError(f"{label}: ranks ran different numbers of steps: {steps}")
    return assemble_records(per_rank)
