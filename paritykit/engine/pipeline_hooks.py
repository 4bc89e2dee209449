"""Work injected into the backward pass: ``TrainPipelineSparseDist.register_backward_hook`` and the
pipeline that runs the optimizer from such a hook (``TrainPipelineSparseDistBwdOpt``).

``HookedDrive`` registers pieces of work on a pipeline, one per way torchrec finds where to hook
(``backward_injection``): on a dense module's parameter gradient (PARAM_GRAD), on the first tensor
needing a gradient in a dense module's output and in another's inputs (ACTIVATION,
``FirstGradTensorFinder``), and,
where the batch crosses ranks, on an embedding module's output-dist tensor (ACTIVATION,
``OutputDistTensorFinder``). Each work records its name; the model's forward and the optimizer's
step record theirs. The promise, checked on the rank: in every step each work runs exactly once,
after that step's forward and before its optimizer step. The numbers must be the plain loop's.

``BackwardOptimizerDrive`` runs ``TrainPipelineSparseDistBwdOpt`` (the dense optimizer steps from a
backward hook at an embedding module's output dist, not after backward); its promise is the plain
loop's numbers too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.engine.pipeline_lifecycle import progress_all
from paritykit.engine.pipeline_runs import make_torchrec_pipeline
from paritykit.errors import HarnessError, ParityError

FORWARD, STEP = "forward", "optimizer step"


def dense_module_names(model: torch.nn.Module, embedding_modules: tuple[str, ...]) -> list[str]:
    """Top-level children of the (DMP-unwrapped) model that hold parameters and are not embedding modules."""
    inner = getattr(model, "module", model)
    return [name for name, child in inner.named_children()
            if name not in embedding_modules and any(True for _ in child.parameters())]


def output_dist_site(model: Any, embedding_modules: tuple[str, ...]) -> tuple[str, Any] | None:
    """(module FQN, sharding type) of an embedding module with a table-wise table: its output dist is
    an all-to-all whose tensor OutputDistTensorFinder hooks; None on one rank (no all-to-all)."""
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingType

    if dist.get_world_size() < 2:
        return None
    inner = getattr(model, "module", model)
    for name in embedding_modules:
        sharding_types = getattr(inner.get_submodule(name), "sharding_type_to_sharding_infos", {})
        if ShardingType.TABLE_WISE.value in sharding_types:
            return name, ShardingType.TABLE_WISE
    return None


@dataclass(frozen=True)
class HookedDrive:
    """A driver (``pipeline_runs.record_on_rank``): ``pipeline`` with backward work at every kind of site."""

    pipeline: str
    embedding_modules: tuple[str, ...]

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        from torchrec.distributed.train_pipeline.backward_injection import (
            FirstGradTensorFinder,
            InjectionSite,
            InjectionTargetType,
            OutputDistTensorFinder,
        )

        dense = dense_module_names(model, self.embedding_modules)
        if not dense:
            raise HarnessError("the model has no dense module to hook a backward work on")
        sites = {f"param-grad {dense[-1]}": InjectionSite(dense[-1], FirstGradTensorFinder(), InjectionTargetType.PARAM_GRAD),
                 f"activation {dense[0]}": InjectionSite(dense[0], FirstGradTensorFinder(), InjectionTargetType.ACTIVATION),
                 f"input {dense[-1]}": InjectionSite(dense[-1], FirstGradTensorFinder(use_input=True), InjectionTargetType.ACTIVATION)}
        found = output_dist_site(model, self.embedding_modules)
        if found is not None:
            sites[f"output-dist {found[0]}"] = InjectionSite(found[0], OutputDistTensorFinder(found[1]), InjectionTargetType.ACTIVATION)
        events: list[str] = []
        pipeline = make_torchrec_pipeline(self.pipeline, model, optimizer, device)
        for name, site in sites.items():
            pipeline.register_backward_hook(site, _Recorder(events, name))
        handle = model.register_forward_hook(lambda *_: events.append(FORWARD))
        step = optimizer.step
        optimizer.step = lambda *a, **k: (events.append(STEP), step(*a, **k))[1]
        try:
            outputs = progress_all(pipeline, iter(batches), len(batches), self.pipeline)
        finally:
            handle.remove()
            del optimizer.step
        check_hook_order(events, list(sites), len(outputs))
        return outputs


@dataclass(frozen=True)
class _Recorder:
    events: list
    name: str

    def __call__(self, _pipeline: Any) -> None:
        self.events.append(self.name)


def check_hook_order(events: list[str], works: list[str], steps: int) -> None:
    """Every step: its forward, each work once (in any order: autograd orders them), then its step."""
    segments: list[list[str]] = []
    for event in events:
        if event == FORWARD:
            segments.append([event])
        elif segments:
            segments[-1].append(event)
        else:
            raise ParityError(f"backward work ran before any forward: {events}")
    if len(segments) != steps:
        raise ParityError(f"{steps} steps ran {len(segments)} forwards: {events}")
    for index, segment in enumerate(segments):
        if segment[-1] != STEP or sorted(segment[1:-1]) != sorted(works):
            raise ParityError(f"step {index} ran {segment}; expected its {FORWARD}, each of {works} once (during backward), "
                              f"then its {STEP}")


@dataclass(frozen=True)
class BackwardOptimizerDrive:
    """A driver: TrainPipelineSparseDistBwdOpt, the dense optimizer stepped from a backward hook at the
    output dist of an embedding module with a table-wise table."""

    embedding_modules: tuple[str, ...]

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        from torchrec.distributed.train_pipeline.experimental_pipelines import TrainPipelineSparseDistBwdOpt

        found = output_dist_site(model, self.embedding_modules)
        if found is None:
            raise HarnessError("TrainPipelineSparseDistBwdOpt needs an embedding module with a table-wise table on 2+ ranks")
        pipeline = TrainPipelineSparseDistBwdOpt(model, optimizer, device, site_fqn=found[0], sharding_type=found[1])
        return progress_all(pipeline, iter(batches), len(batches), "TrainPipelineSparseDistBwdOpt")
