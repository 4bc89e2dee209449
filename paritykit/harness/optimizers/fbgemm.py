"""How a fused OptimizerSpec reaches torchrec, and which fused optimizers the installed fbgemm trains.

A user marks tables for torchrec's fused optimizer with
``apply_optimizer_in_backward(cls, params, kwargs)``; torchrec turns ``cls`` into fbgemm's
``EmbOptimType`` (``torchrec.distributed.utils``) unless ``kwargs`` names one itself (``optimizer=``,
how EMA in-place row-wise Adagrad and row-wise RMSprop are chosen: torchrec has no class for them),
renames ``lr`` to ``learning_rate`` and passes every other keyword to fbgemm's TBE constructor. So
paritykit gives torchrec exactly what a user would: the class, and fbgemm's own types (WeightDecayMode,
CounterBasedRegularizationDefinition, EmainplaceModeDefinition) built from the spec's plain values.

Which optimizers run is read from fbgemm itself, never from a version number: an ``EmbOptimType``
member the installed fbgemm lacks, or whose TBE refuses to train on the CPU, is not offered there.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch

from paritykit.harness.optimizers.catalog import FUSED, import_class
from paritykit.harness.optimizers.spec import OptimizerSpec


@functools.lru_cache(maxsize=None)
def _trains_on_cpu(emb_opt_type: str) -> bool:
    """Whether fbgemm has ``emb_opt_type`` and its TBE takes one training step on the CPU."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    member = getattr(EmbOptimType, emb_opt_type, None)
    if member is None:
        return False
    try:
        tbe = SplitTableBatchedEmbeddingBagsCodegen([(4, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=member)
        tbe(torch.tensor([1, 2]), torch.tensor([0, 1, 2])).sum().backward()
    except (AssertionError, RuntimeError, NotImplementedError):  # fbgemm's own refusals
        return False
    return True


def supported_fused_optimizers(device: str = "cpu") -> tuple[str, ...]:
    """The fused optimizers of the catalog that the installed fbgemm trains on ``device``.

    On CUDA every catalog entry whose ``EmbOptimType`` fbgemm has (its GPU kernels are a superset of
    the CPU ones); on the CPU those whose TBE trains there."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if torch.device(device).type == "cuda":
        return tuple(name for name, entry in FUSED.items() if hasattr(EmbOptimType, entry.emb_opt_type))
    return tuple(name for name, entry in FUSED.items() if _trains_on_cpu(entry.emb_opt_type))


@functools.lru_cache(maxsize=None)
def _cpu_kernel_applies(mode: str) -> bool:
    """Whether fbgemm's CPU row-wise Adagrad moves a table differently with weight decay in ``mode``."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    spec = OptimizerSpec("rowwise_adagrad", 0.5, eps=1e-3, weight_decay=0.5, weight_decay_mode=mode, counter_halflife=1,
                         counter_weight_decay_mode="decouple" if mode == "counter" else "none")
    tables = []
    for decay in (0.0, 0.5):
        _cls, kwargs = in_backward_arguments(spec)
        kwargs.update(learning_rate=kwargs.pop("lr"), weight_decay=decay)
        tbe = SplitTableBatchedEmbeddingBagsCodegen([(4, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                    optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, **kwargs)
        with torch.no_grad():
            tbe.split_embedding_weights()[0].fill_(1.0)
        tbe(torch.tensor([1, 2]), torch.tensor([0, 1, 2])).sum().backward()
        tables.append(tbe.split_embedding_weights()[0].clone())
    return not torch.equal(*tables)


def applied_weight_decay_modes(device: str = "cpu") -> tuple[str, ...]:
    """The row-wise Adagrad weight-decay modes whose decay fbgemm's kernel on ``device`` applies.

    Measured on the CPU (a one-step TBE with and without decay): fbgemm-gpu-cpu 1.8.0 and 1.9.0 apply
    the counter-based mode but not L2 or DECOUPLE. The CUDA kernels apply every mode."""
    modes = ("l2", "decouple", "counter")
    if torch.device(device).type == "cuda":
        return modes
    return tuple(mode for mode in modes if _cpu_kernel_applies(mode))


def fbgemm_weight_decay_mode(mode: str) -> Any:
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    return {"none": WeightDecayMode.NONE, "l2": WeightDecayMode.L2, "decouple": WeightDecayMode.DECOUPLE,
            "counter": WeightDecayMode.COUNTER}[mode]


def _counter_definition(spec: OptimizerSpec) -> Any:
    from fbgemm_gpu.tbe.config.optimizer_config import CounterBasedRegularizationDefinition, CounterWeightDecayMode

    mode = {"none": CounterWeightDecayMode.NONE, "l2": CounterWeightDecayMode.L2,
            "decouple": CounterWeightDecayMode.DECOUPLE}[spec.hyper("counter_weight_decay_mode")]
    return CounterBasedRegularizationDefinition(counter_weight_decay_mode=mode, counter_halflife=spec.hyper("counter_halflife"))


def in_backward_arguments(spec: OptimizerSpec) -> tuple[type, dict[str, Any]]:
    """(class, kwargs) for ``apply_optimizer_in_backward``, as a user would write them for ``spec``."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    fused = spec.fused
    kwargs: dict[str, Any] = {"lr": spec.lr}
    if "eps" in (h.name for h in fused.hypers):
        kwargs["eps"] = spec.hyper("eps")
    if fused.explicit_type:
        kwargs["optimizer"] = getattr(EmbOptimType, fused.emb_opt_type)
    if spec.name == "rowwise_adagrad":
        mode = spec.hyper("weight_decay_mode")
        kwargs.update(weight_decay=spec.hyper("weight_decay"), weight_decay_mode=fbgemm_weight_decay_mode(mode))
        if mode == "counter":
            kwargs["counter_based_regularization"] = _counter_definition(spec)
    elif spec.name == "ema_rowwise_adagrad":
        from fbgemm_gpu.tbe.config.optimizer_config import EmainplaceModeDefinition

        kwargs["emainplace_mode"] = EmainplaceModeDefinition(
            step_ema=spec.hyper("step_ema"), step_start=spec.hyper("step_start"), step_ema_coef=spec.hyper("step_ema_coef"))
    elif spec.name == "rowwise_rmsprop_ar":
        kwargs.update({key: spec.hyper(key) for key in ("ar_alpha", "ema_beta", "min_shrinkage")})
    return import_class(fused.torchrec_class), kwargs


def apply_in_backward(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> None:
    """Mark embedding tables for torchrec's fused optimizer (what a user does before sharding)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    cls, kwargs = in_backward_arguments(spec)
    apply_optimizer_in_backward(cls, list(params), kwargs)
