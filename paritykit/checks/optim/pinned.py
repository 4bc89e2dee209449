"""Cases every run covers: each wrapper as users stack it over a sharded model whose tables mix
table-, row-, column-wise and data-parallel placements with fused and dense kernels."""

from __future__ import annotations

import math

from paritykit.checks.optim.cases import OptimCase
from paritykit.engine.optim_wrapping import (Clipping, DenseGroup, HyperParameterChange, LearningRateChange, OptimizerWrapping, Warmup,
                                             WarmupStageSpec)
from paritykit.harness.tables import TableSpec

TABLES = (TableSpec("t0", 12, 8, ("f0",)), TableSpec("t1", 10, 8, ("f1",)), TableSpec("t2", 8, 4, ("f2",)),
          TableSpec("t3", 10, 4, ("f3",)))
# Small enough that every step clips: each case must exercise what it is about.
SMALL = 0.05
# Far above every gradient norm of these cases (2-11): clipping must leave the gradients alone.
SAFETY_NET = 1000.0

# t0 has one row that four features look up: its gradient sums their ids over the global batch and
# outgrows the data-parallel table's; with only the tables trained (and clipped), the inf norm's
# maximum lies on t0's rank alone, and the other rank learns it only from the all-reduce.
HOT_TABLES = (TableSpec("t0", 1, 8, ("f0", "f4", "f5", "f6")),) + TABLES[1:]


def _plan(last: int) -> dict[str, tuple]:
    return {"t0": ("row_wise",), "t1": ("column_wise", (0, last)), "t2": ("data_parallel",), "t3": ("table_wise", last)}


WARMUP = Warmup((WarmupStageSpec("linear", max_iters=2, value=0.25), WarmupStageSpec("step", max_iters=4, value=0.5),
                 WarmupStageSpec("cosine_annealing_warm_restarts", max_iters=6, value=0.2, sgdr_period=3)), lr=0.2)


def pinned_cases(world_size: int) -> tuple[OptimCase, ...]:
    last = world_size - 1
    dense_rw_cw = {"t0": "dense", "t1": "dense"}
    return (
        OptimCase(world_size, TABLES, _plan(last), OptimizerWrapping(
            dense=(DenseGroup("dense", "adam", lr=0.05),), clipping=Clipping("norm", SMALL, 2.0, across_ranks=True),
            hyper_parameter_changes=(HyperParameterChange(2, (("eps", 0.1),)),)),
            kernels=dense_rw_cw, embedding_optimizer="adagrad", seed=1, label="clip norm 2 across ranks, fused eps updated"),
        OptimCase(world_size, TABLES, {**_plan(last), "t0": ("table_wise", 0)}, OptimizerWrapping(
            dense=(DenseGroup("dense", "sgd", kwargs=(("momentum", 0.9),)),),
            clipping=Clipping("norm", SMALL, math.inf, across_ranks=True)),
            kernels=dense_rw_cw, embedding_optimizer="rowwise_adagrad", seed=2, label="clip inf norm across ranks"),
        OptimCase(world_size, TABLES, _plan(last), OptimizerWrapping(
            dense=(DenseGroup("dense", "adagrad"),), clipping=Clipping("value", 0.02)),
            kernels={"t1": "dense"}, seed=3, label="clip value"),
        OptimCase(world_size, TABLES, _plan(last), OptimizerWrapping(
            dense=(DenseGroup("dense", "sgd"),), clipping=Clipping("norm", 0.5), warmup=WARMUP),
            embedding_optimizer="adagrad", steps=7, seed=4, label="warm-up stages"),
        OptimCase(world_size, TABLES, _plan(last), OptimizerWrapping(
            dense=(DenseGroup("matrices", "rowwise_adagrad", lr=0.1, selects="matrices",
                              kwargs=(("lr_decay", 0.1), ("weight_decay", 0.01), ("initial_accumulator_value", 0.1), ("eps", 1e-8))),
                   DenseGroup("vectors", "adam", lr=0.02, selects="vectors")),
            lr_changes=(LearningRateChange(1, "fused", 0.5), LearningRateChange(2, "matrices", 2.0)),
            clipping=Clipping("none", norm_type=2.0, across_ranks=True)),
            kernels=dense_rw_cw, seed=5, label="row-wise Adagrad on dense parameters, lr changes per optimizer, norm tracked"),
        OptimCase(world_size, TABLES, _plan(last), OptimizerWrapping(
            dense=(DenseGroup("dense", "adam", lr=0.05),), clipping=Clipping("norm", SAFETY_NET, 2.0, across_ranks=True),
            lr_changes=(LearningRateChange(1, "fused", 0.5), LearningRateChange(1, "dense", 0.25)), resume_at=2),
            kernels=dense_rw_cw, embedding_optimizer="adagrad", seed=6,
            label="state_dict round trip into fresh wrappers, clipping as a safety net"),
        OptimCase(world_size, HOT_TABLES, {**_plan(last), "t0": ("table_wise", 0)}, OptimizerWrapping(
            dense=(DenseGroup("tables", "sgd", selects="tables"),), clipping=Clipping("norm", SMALL, math.inf, across_ranks=True)),
            kernels=dense_rw_cw, seed=7, label="clip inf norm across ranks, the largest gradient in one rank's table"),
    )
