"""torchrec's pipeline classes and constructor options beyond the nine of ``pipeline_runs.PIPELINES``.

Each entry names a class (in ``train_pipelines`` or ``experimental_pipelines``), the options it is
built with and what it promises against a plain loop over the same model:

- ``exact``: the plain loop's numbers bit for bit (another schedule, thread or copy of the same steps);
- ``semi_sync``: exact through ``start_batch``, then within the SemiSync bounds (stashed gradients,
  dense steps one batch late);
- ``stops_with_data``: ``execute_all_batches=False`` stops when the dataloader runs dry, so the two
  batches in flight are never trained: the plain loop over all batches but the last two;
- ``eval``: no training; the model's eval forward on every batch (``pipeline_eval.py`` drives these).

An entry is present where this torchrec has the class and its constructor takes the options
(``missing`` says why not): detected by feature, never by version number.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

EXACT, SEMI_SYNC, STOPS_WITH_DATA, EVAL = "exact", "semi_sync", "stops_with_data", "eval"
# TrainPipelinePT2 compiles the model at this iteration; the gate's runs never reach it (see docs/pipeline.md).
NEVER_COMPILE = 2**31
# TrainPipelineSemiSync with this start batch never runs semi-synchronously: the plain loop's numbers.
NEVER_SEMI_SYNC = 2**31
# execute_all_batches=False: how many batches are still in flight when the dataloader runs dry.
IN_FLIGHT_AT_STOP = 2


@dataclass(frozen=True)
class Variant:
    """One torchrec pipeline class with constructor options, and its promise."""

    class_name: str
    options: tuple[tuple[str, Any], ...] = ()
    promise: str = EXACT
    module: str = "train_pipelines"

    def torchrec_class(self) -> type | None:
        import importlib

        try:
            module = importlib.import_module(f"torchrec.distributed.train_pipeline.{self.module}")
        except ImportError:
            return None
        return getattr(module, self.class_name, None)

    def missing(self) -> str:
        """Why this torchrec cannot build the variant, or "" when it can."""
        cls = self.torchrec_class()
        if cls is None:
            return f"this torchrec has no {self.module}.{self.class_name}"
        unknown = [name for name, _ in self.options if not accepts(cls, name)]
        return f"{self.class_name} takes no {', '.join(unknown)} in this torchrec" if unknown else ""


def accepts(cls: type, option: str) -> bool:
    """Whether ``cls(...)`` takes keyword ``option``, following ``**kwargs`` up the class hierarchy."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters
        if option in parameters:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return False
    return False


def _inplace(**extra: Any) -> tuple[tuple[str, Any], ...]:
    return (("enable_inplace_copy_batch", True),) + tuple(extra.items())


VARIANTS: dict[str, Variant] = {
    "base:inplace_copy": Variant("TrainPipelineBase", _inplace()),
    "sparse_dist:inplace_copy": Variant("TrainPipelineSparseDist", _inplace()),
    "sparse_dist:enqueue_after_forward": Variant("TrainPipelineSparseDist", (("enqueue_batch_after_forward", True),)),
    "sparse_dist:free_inputs_early": Variant(
        "TrainPipelineSparseDist", (("free_features_storage_early", True), ("clear_data_dist_inputs", True))),
    "sparse_dist:postproc": Variant("TrainPipelineSparseDist", (("pipeline_postproc", True),)),
    "sparse_dist:jit": Variant("TrainPipelineSparseDist", (("apply_jit", True),)),
    "sparse_dist:stop_with_data": Variant("TrainPipelineSparseDist", (("execute_all_batches", False),), STOPS_WITH_DATA),
    "lite": Variant("TrainPipelineSparseDistLite"),
    "lite:inplace_copy": Variant("TrainPipelineSparseDistLite", _inplace(clear_data_dist_inputs=True)),
    "threaded": Variant("TrainPipelineSparseDistT", module="experimental_pipelines"),
    "threaded:inplace_copy": Variant("TrainPipelineSparseDistT", _inplace(), module="experimental_pipelines"),
    "threaded:jit": Variant("TrainPipelineSparseDistT", (("apply_jit", True),), module="experimental_pipelines"),
    "hybrid": Variant("TrainEvalHybridPipelineBase", module="experimental_pipelines"),
    "pt2:eager": Variant("TrainPipelinePT2"),
    "fused:no_postproc": Variant("TrainPipelineFusedSparseDist", (("pipeline_postproc", False),)),  # its default is True
    "fused:data_dist:free_inputs": Variant(
        "TrainPipelineFusedSparseDist", _inplace(clear_data_dist_inputs=True, enqueue_batch_after_forward=True)),
    "semi_sync:stash_gradients": Variant("TrainPipelineSemiSync", (("stash_gradients", True),), SEMI_SYNC),
    "semi_sync:free_inputs": Variant("TrainPipelineSemiSync", _inplace(clear_data_dist_inputs=True), SEMI_SYNC),
    # A start batch the run never reaches: every lookup after the previous update, to the end of the data.
    "semi_sync:never_starts": Variant("TrainPipelineSemiSync", (("start_batch", NEVER_SEMI_SYNC),)),
    "eval:sparse_dist": Variant("EvalPipelineSparseDist", promise=EVAL),
    "eval:fused": Variant("EvalPipelineFusedSparseDist", promise=EVAL),
    "eval:fused:after_dd": Variant("EvalPipelineFusedSparseDist", (("embedding_lookup_after_data_dist", True),), EVAL),
    "eval:fused:lookup_ahead": Variant(
        "EvalPipelineFusedSparseDist", (("emb_lookup_stream", "new"), ("enable_embedding_lookup_prefetch", True)), EVAL),
    "eval:hybrid": Variant("TrainEvalHybridPipelineBase", promise=EVAL, module="experimental_pipelines"),
}


def available(promise: str | None = None) -> tuple[str, ...]:
    """The variants this torchrec can build (with ``promise``, only those promising it)."""
    return tuple(name for name, v in VARIANTS.items() if not v.missing() and promise in (None, v.promise))


def build_variant(name: str, model: Any, optimizer: Any, device: torch.device, semi_sync_start_batch: int = 0) -> Any:
    """torchrec's pipeline object for the variant called ``name``."""
    variant = VARIANTS[name]
    why = variant.missing()
    if why:
        raise ValueError(f"pipeline {name!r} cannot be built: {why}")
    kwargs = dict(variant.options)
    if variant.class_name == "TrainPipelineSemiSync":
        kwargs.setdefault("start_batch", semi_sync_start_batch)
    if variant.class_name == "TrainPipelinePT2":
        from torchrec.distributed.train_pipeline.train_pipelines import TorchCompileConfig

        kwargs["compile_configs"] = TorchCompileConfig(compile_on_iter=NEVER_COMPILE)
    return variant.torchrec_class()(model=model, optimizer=optimizer, device=device, **kwargs)


def promise_of(name: str) -> str:
    return VARIANTS[name].promise
