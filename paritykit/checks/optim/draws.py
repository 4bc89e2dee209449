"""Hypothesis draws of optimizer-wrapper cases.

Sharded: 2-4 tables placed table-, row-, column-wise or data-parallel, fused or dense kernels; the
fused optimizer (SGD, Adagrad, row-wise Adagrad); one dense optimizer or one for matrices and one
for vectors (SGD with momentum, Adagrad, Adam, torchrec's RowWiseAdagrad) with drawn
hyper-parameters; clipping by norm (p = 1, 2 or inf; across ranks wherever a dense optimizer trains
local shards, the only configuration whose norm is the model's), by value, or none (the norm only
tracked), with thresholds below,
between and above the gradients' norms; warm-up stages of every policy; the user's lr changes per
optimizer, ``update_hyper_parameters`` of the fused optimizer's eps; a resume from the wrappers' state dicts at any step.

Dense (no ranks): RowWiseAdagrad hyper-parameters, warm-up schedules, keyed state round trips,
SemisyncOptimizer's local/global rhythm.
Combinations that fail inside torchrec are repaired away (known_broken.py) and run on their own.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from paritykit.checks.optim.cases import OptimCase
from paritykit.checks.optim.contract_cases import SemiSyncCase
from paritykit.checks.optim.dense_cases import KeyedCase, RowWiseCase, ScheduleCase
from paritykit.checks.optim.known_broken import repair
from paritykit.checks.optim.step_forms import STEP_FORMS
from paritykit.engine.optim_wrapping import (Clipping, DenseGroup, HyperParameterChange, LearningRateChange, OptimizerWrapping, Warmup,
                                             WarmupStageSpec)
from paritykit.harness.tables import TableSpec

EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
LRS = (0.01, 0.05, 0.1, 0.2)
# Gradient norms of these models are about 1-12: below, inside and far above that range.
MAX_NORMS = (0.05, 3.0, 1000.0)
MAX_VALUES = (0.01, 0.1, 10.0)
NORM_TYPES = (1.0, 2.0, math.inf)


@st.composite
def dense_group(draw: Any, name: str, selects: str) -> DenseGroup:
    choices = ("sgd", "adagrad", "adam") + (("rowwise_adagrad",) if selects == "matrices" else ())
    optimizer = draw(st.sampled_from(choices))
    kwargs: dict[str, Any] = {}
    if optimizer == "sgd" and draw(st.booleans()):
        kwargs["momentum"] = draw(st.sampled_from((0.5, 0.9)))
    if optimizer in ("adagrad", "rowwise_adagrad"):
        kwargs["lr_decay"] = draw(st.sampled_from((0.0, 0.1)))
        kwargs["initial_accumulator_value"] = draw(st.sampled_from((0.0, 0.1)))
    if optimizer != "sgd" and draw(st.booleans()):
        kwargs["weight_decay"] = 0.01
    return DenseGroup(name, optimizer, lr=draw(st.sampled_from(LRS)), kwargs=tuple(sorted(kwargs.items())), selects=selects)


@st.composite
def warmup_stage_list(draw: Any, first_may_be_inv_sqrt: bool = False) -> Warmup:
    stages, end = [], 0
    for index in range(draw(st.integers(1, 3))):
        policies = [p for p in ("linear", "constant", "poly", "step", "inv_sqrt", "cosine_annealing_warm_restarts", "interpolate")
                    if p != "inv_sqrt" or index > 0 or first_may_be_inv_sqrt]
        policy, start, end = draw(st.sampled_from(policies)), end, end + draw(st.integers(1, 3))
        value = draw(st.sampled_from((0.1, 0.5, 2.0) if policy == "poly" else (0.1, 0.5, 0.9)))
        extra: dict[str, Any] = {"lr_scale": draw(st.sampled_from((1.0, 1.0, 0.5)))}
        if policy == "step":
            extra["decay_iters"] = draw(st.sampled_from((-1, 2)))
        if policy == "cosine_annealing_warm_restarts":
            extra["sgdr_period"] = draw(st.integers(1, 3))
        if policy == "interpolate":
            extra.update(start_interpolating_iters=start, end_value=draw(st.sampled_from((0.0, 1.0))))
        stages.append(WarmupStageSpec(policy, end, value, **extra))
    return Warmup(tuple(stages), lr=draw(st.sampled_from(LRS)))


def _placement(draw: Any, world_size: int) -> tuple:
    kind = draw(st.sampled_from(("table_wise", "row_wise", "column_wise", "data_parallel")))
    rank = st.integers(0, world_size - 1)
    if kind == "table_wise":
        return (kind, draw(rank))
    if kind == "column_wise":
        return (kind, tuple(draw(st.lists(rank, min_size=1, max_size=2))))
    return (kind,)


@st.composite
def sharded_cases(draw: Any, world_size: int) -> OptimCase:
    tables, plan, kernels = [], {}, {}
    for i in range(draw(st.integers(2, 4))):
        entry = _placement(draw, world_size)
        width = 4 * len(entry[1]) if entry[0] == "column_wise" else draw(st.sampled_from((4, 8)))
        tables.append(TableSpec(f"t{i}", draw(st.integers(8, 16)), width, (f"f{i}",)))
        plan[f"t{i}"] = entry
        kernels[f"t{i}"] = draw(st.sampled_from(("fused", "dense")))
    dense = ((draw(dense_group("dense", "all")),) if draw(st.booleans())
             else (draw(dense_group("matrices", "matrices")), draw(dense_group("vectors", "vectors"))))
    steps = draw(st.integers(3, 4))
    case = OptimCase(world_size, tuple(tables), plan, OptimizerWrapping(dense=dense), kernels=kernels,
                     embedding_optimizer=draw(st.sampled_from(EMBEDDING_OPTIMIZERS)), steps=steps, seed=draw(st.integers(0, 2**16)))
    clipping = _clipping(draw, world_size > 1 and bool(case.model_parallel_dense_tables()))
    warmup = draw(st.none() | warmup_stage_list())
    names = ("fused", *(g.name for g in dense))
    changes = () if warmup else tuple(LearningRateChange(draw(st.integers(1, steps - 1)), draw(st.sampled_from(names)),
                                                         draw(st.sampled_from((0.5, 2.0)))) for _ in range(draw(st.integers(0, 2))))
    resume = draw(st.none() | st.integers(1, steps - 1))
    hyper = ()
    if case.embedding_optimizer != "sgd" and draw(st.booleans()):
        values = (("eps", draw(st.sampled_from((1e-3, 0.1)))),) + ((("lr", 0.02),) if draw(st.booleans()) else ())
        hyper = (HyperParameterChange(draw(st.integers(1, steps - 1)), values),)
    wrapping = OptimizerWrapping(dense=dense, clipping=clipping, warmup=warmup, lr_changes=changes, hyper_parameter_changes=hyper,
                                 resume_at=resume)
    return repair(OptimCase(world_size, case.tables, plan, wrapping, kernels=kernels, embedding_optimizer=case.embedding_optimizer,
                            steps=steps, seed=case.seed))


def _clipping(draw: Any, local_shards: bool) -> Clipping | None:
    mode = draw(st.sampled_from((None, "norm", "value", "none")))
    if mode is None:
        return None
    if mode == "value":
        return Clipping("value", draw(st.sampled_from(MAX_VALUES)))
    if mode == "none":
        return Clipping("none", norm_type=draw(st.sampled_from(NORM_TYPES)), across_ranks=draw(st.booleans()))
    # Clipping by norm over local shards without the process groups computes each rank's own norm
    # (replicas then diverge, docs/optim.md): across ranks is the configuration with the model's norm.
    across = True if local_shards else draw(st.booleans())
    return Clipping("norm", draw(st.sampled_from(MAX_NORMS)), draw(st.sampled_from(NORM_TYPES)), across_ranks=across)


@st.composite
def dense_cases(draw: Any) -> Any:
    kind = draw(st.sampled_from(("rowwise", "schedule", "keyed", "semi-sync")))
    seed = draw(st.integers(0, 2**16))
    if kind == "semi-sync":
        return repair(SemiSyncCase(draw(st.integers(1, 3)), draw(st.sampled_from((0.3, 0.7, 1.0))), draw(st.sampled_from(("sgd", "adam"))),
                                   steps=draw(st.integers(3, 7)), resume_at=draw(st.none() | st.integers(1, 2)),
                                   local_lr_factor=draw(st.sampled_from((1.0, 0.5))), seed=seed,
                                   global_only=draw(st.booleans())))
    if kind == "rowwise":
        kwargs = {"lr": draw(st.sampled_from(LRS)), "lr_decay": draw(st.sampled_from((0.0, 0.05, 0.5))),
                  "weight_decay": draw(st.sampled_from((0.0, 0.01, 0.1))), "eps": draw(st.sampled_from((1e-10, 1e-8, 1e-3))),
                  "initial_accumulator_value": draw(st.sampled_from((0.0, 0.1, 1.0))), "maximize": draw(st.booleans())}
        steps = draw(st.integers(2, 5))
        return RowWiseCase(tuple(sorted(kwargs.items())), steps=steps, seed=seed, resume_at=draw(st.none() | st.integers(1, steps - 1)),
                           step_saved_as=draw(st.sampled_from(STEP_FORMS)))
    if kind == "schedule":
        warmup = draw(warmup_stage_list(first_may_be_inv_sqrt=True))
        steps = warmup.stages[-1].max_iters + draw(st.integers(1, 3))
        return repair(ScheduleCase(warmup, steps, resume_at=draw(st.none() | st.integers(1, steps - 1)), seed=seed,
                                   in_combined=draw(st.booleans())))
    return KeyedCase((draw(st.sampled_from((0.5, 1.0, 2.0))), draw(st.sampled_from((0.5, 2.0)))),
                     resume_at=draw(st.integers(1, 3)), seed=seed)
