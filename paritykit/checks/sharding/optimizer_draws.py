"""The optimizers of the sharding check: what the drawn cases train with, the pinned optimizer cases,
and the two optimizer combinations known to fail (kept out of the draws, run on purpose).

Every drawn case carries a fused embedding optimizer from fbgemm's CPU kernels (exact SGD, exact
Adagrad, exact row-wise Adagrad with its weight-decay modes, EMA in-place row-wise Adagrad, and
row-wise RMSprop with adaptive regularization where fbgemm has it) and a dense torch optimizer
(SGD with momentum/nesterov/weight decay, Adagrad, Adam, AdamW), each with drawn hyper-parameters
(``paritykit.strategies.optimizers``). A hyper-parameter torchrec fails to hand to fbgemm then
moves the sharded numbers away from the reference.

Known to fail, each a rule of known_broken.py with an entry in known_issues.toml:

- ``ec-fused-optimizer-type-ignored``: torchrec's EmbeddingCollection sharder derives the fused
  optimizer from the class given to ``apply_optimizer_in_backward`` even when the keyword arguments
  name one (``optimizer=EmbOptimType...``, the only way to choose EMA in-place row-wise Adagrad or
  row-wise RMSprop); the EmbeddingBagCollection sharder honours it. The EC trains with plain
  row-wise Adagrad.
- ``cpu-row-wise-adagrad-weight-decay-ignored``: fbgemm's CPU row-wise Adagrad kernel applies no
  weight decay in modes L2 and DECOUPLE (the counter-based mode does apply it).
- ``one-row-shard-row-states-as-single-values``: torchrec takes a per-row optimizer state of one
  element for a single-value state, so on a rank whose row shard has one row, prev_iter (and
  row_counter) say they are element ``rank`` of a tensor of ``world size`` elements.
"""

from __future__ import annotations

import dataclasses
import functools

from hypothesis import strategies as st

from paritykit.checks.sharding.cases import RankBatch, ShardingCase
from paritykit.harness.optimizers import FUSED, OptimizerSpec, supported_fused_optimizers
from paritykit.harness.optimizers.catalog import WEIGHT_DECAY_MODES
from paritykit.harness.plans import ROW_WISE_FAMILY, row_shard_sizes
from paritykit.harness.tables import TableSpec
from paritykit.strategies.optimizers import dense_optimizer_specs, embedding_optimizer_specs

# fbgemm's TBE takes a variable batch per feature with every CPU optimizer but exact Adagrad (it asserts so).
VBE_REFUSED = ("adagrad",)
DENSE_DRAWN = ("sgd", "adagrad", "adam", "adamw")


@functools.lru_cache(maxsize=None)
def embedding_optimizers(vbe: bool = False) -> st.SearchStrategy[OptimizerSpec]:
    # Every weight-decay mode: the known-issue rule below keeps out what fbgemm's CPU kernel ignores.
    names = [name for name in supported_fused_optimizers("cpu") if not (vbe and name in VBE_REFUSED)]
    return embedding_optimizer_specs(names, weight_decay_modes=WEIGHT_DECAY_MODES)


@functools.lru_cache(maxsize=None)
def dense_optimizers() -> st.SearchStrategy[OptimizerSpec]:
    return dense_optimizer_specs(DENSE_DRAWN)


def _spec(case: ShardingCase) -> OptimizerSpec:
    return OptimizerSpec.of(case.optimizer)


def ec_with_explicit_fused_type(case: ShardingCase) -> bool:
    spec = _spec(case)
    return case.module == "ec" and spec.fused is not None and spec.fused.explicit_type


def with_class_derived_type(case: ShardingCase) -> ShardingCase:
    """The same learning rate and eps with plain row-wise Adagrad (what the class says)."""
    spec = _spec(case)
    return dataclasses.replace(case, optimizer=OptimizerSpec("rowwise_adagrad", spec.lr, eps=spec.hyper("eps")))


def uses_cpu_ignored_weight_decay(case: ShardingCase) -> bool:
    spec = _spec(case)
    fused_tables = any(case.trained_kernel(t) == "fused" for t in case.plan)
    return (fused_tables and spec.name == "rowwise_adagrad" and spec.hyper("weight_decay_mode") in ("l2", "decouple")
            and spec.hyper("weight_decay") > 0)


def with_counter_weight_decay(case: ShardingCase) -> ShardingCase:
    """The same weight decay and mode through counter-based regularization (half-life 1), which the CPU kernel applies."""
    spec = _spec(case)
    kwargs = {**spec.kwargs, "weight_decay_mode": "counter", "counter_weight_decay_mode": spec.hyper("weight_decay_mode"),
              "counter_halflife": 1}
    return dataclasses.replace(case, optimizer=OptimizerSpec(spec.name, spec.lr, **kwargs))


def _keeps_row_states_besides_momentum1(spec: OptimizerSpec) -> bool:
    """fbgemm keeps per-row states other than momentum1: prev_iter (and row_counter) of counter-based
    row-wise Adagrad and of row-wise RMSprop with adaptive regularization."""
    return spec.name == "rowwise_rmsprop_ar" or (spec.name == "rowwise_adagrad" and spec.hyper("weight_decay_mode") == "counter")


def _row_shards(case: ShardingCase, table: TableSpec) -> int:
    """How many row shards a row-wise-family table is cut into: every rank (row-wise), or the ranks of
    one host (table-row-wise, each grid block)."""
    return case.world_size if case.plan[table.name][0] == "row_wise" else case.hosts.ranks_per_host


def _has_one_row_shard(case: ShardingCase, table: TableSpec) -> bool:
    if case.plan[table.name][0] not in ROW_WISE_FAMILY or case.trained_kernel(table.name) != "fused":
        return False
    return 1 in row_shard_sizes(table.num_embeddings, _row_shards(case, table))


def one_row_shard_with_row_states(case: ShardingCase) -> bool:
    return _keeps_row_states_besides_momentum1(_spec(case)) and any(_has_one_row_shard(case, t) for t in case.tables)


def with_two_rows_per_shard(case: ShardingCase) -> ShardingCase:
    """Tables whose row shards include one of a single row get rows for two or more in every shard."""
    def grown(table: TableSpec) -> TableSpec:
        if not _has_one_row_shard(case, table):
            return table
        shards = _row_shards(case, table)
        return dataclasses.replace(table, num_embeddings=max(2, -(-table.num_embeddings // shards)) * shards)

    return dataclasses.replace(case, tables=tuple(grown(t) for t in case.tables))


_IDS = (
    (("f0", ((1, 2), (), (3, 3))), ("f1", ((0,), (4, 5), ())), ("f2", ((6,), (), (7, 1)))),
    (("f0", ((4,), (5, 6), (1,))), ("f1", ((1,), (), (2, 3))), ("f2", ((), (2,), (5,)))),
)


def _steps(world_size: int, steps: int = 3) -> tuple[tuple[RankBatch, ...], ...]:
    # Rows 0-7 of every table are read; rows 8 and 9 of t0 never are (sparse updates must leave them).
    return tuple(tuple(RankBatch(_IDS[(rank + step) % 2]) for rank in range(world_size)) for step in range(steps))


def optimizer_pinned_cases(world_size: int) -> tuple[ShardingCase, ...]:
    """Cases every run covers: each fused optimizer with hyper-parameters far from fbgemm's defaults,
    beside dense optimizers with theirs, over column-wise shards (per-shard row state) and others."""
    last = world_size - 1
    sums = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2")), TableSpec("t2", 8, 8, ("f2",)))
    ec_tables = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1",)), TableSpec("t2", 8, 8, ("f2",)))
    counter = OptimizerSpec("rowwise_adagrad", 0.1, eps=1e-3, weight_decay=0.05, weight_decay_mode="counter",
                            counter_halflife=2, counter_weight_decay_mode="decouple")
    adam = OptimizerSpec("adam", 0.05, betas=(0.8, 0.99), eps=1e-3, weight_decay=0.01)
    cases = [
        ShardingCase("ebc", world_size, sums, {"t0": ("column_wise", (last, 0)), "t1": ("row_wise",), "t2": ("data_parallel",)},
                     optimizer=counter, dense_optimizer=adam, steps=_steps(world_size), seed=31),
        ShardingCase("ec", world_size, ec_tables, {"t0": ("column_wise", (last, 0)), "t1": ("table_wise", 0), "t2": ("row_wise",)},
                     optimizer=OptimizerSpec("adagrad", 0.1, eps=0.1), steps=_steps(world_size), seed=32),
        ShardingCase("ebc", world_size, sums, {"t0": ("column_wise", (0, last)), "t1": ("table_column_wise", (last, 0)),
                     "t2": ("data_parallel",)},
                     optimizer=OptimizerSpec("ema_rowwise_adagrad", 0.1, eps=1e-3, step_ema=2, step_start=1, step_ema_coef=0.5),
                     dense_optimizer=OptimizerSpec("sgd", 0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                     steps=_steps(world_size), seed=33),
    ]
    if "rowwise_rmsprop_ar" in supported_fused_optimizers("cpu"):
        cases.append(ShardingCase(
            "ebc", world_size, sums, {"t0": ("column_wise", (last, 0)), "t1": ("table_wise", 0), "t2": ("row_wise",)},
            optimizer=OptimizerSpec("rowwise_rmsprop_ar", 0.1, eps=1e-3, ar_alpha=0.5, ema_beta=0.9, min_shrinkage=0.2),
            steps=_steps(world_size), seed=34))
    return tuple(cases)


def optimizer_known_broken_cases(world_size: int) -> dict[str, ShardingCase]:
    """One small case per optimizer rule, failing the way the rule says (rule name -> case)."""
    ec_tables = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1",)), TableSpec("t2", 8, 8, ("f2",)))
    sums = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2")))
    explicit = next(name for name, entry in FUSED.items() if entry.explicit_type and name in supported_fused_optimizers("cpu"))
    explicit_spec = OptimizerSpec(explicit, 0.1, eps=1e-3, **({"step_ema": 1, "step_ema_coef": 0.5} if explicit == "ema_rowwise_adagrad" else {}))
    return {
        "ec-fused-optimizer-type-ignored": ShardingCase(
            "ec", world_size, ec_tables, {"t0": ("table_wise", 0), "t1": ("table_wise", 0), "t2": ("table_wise", 0)},
            optimizer=explicit_spec, steps=_steps(world_size, steps=1), seed=35),
        "one-row-shard-row-states-as-single-values": ShardingCase(
            "ebc", world_size, (TableSpec("t0", 3, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1",))),
            {"t0": ("row_wise",), "t1": ("table_wise", 0)},
            optimizer=OptimizerSpec("rowwise_adagrad", 0.1, eps=1e-3, weight_decay=0.1, weight_decay_mode="counter",
                                    counter_halflife=1, counter_weight_decay_mode="l2"),
            steps=(tuple(RankBatch((("f0", ((0, 2), (1,))), ("f1", ((3,), (4, 5))))) for _ in range(world_size)),), seed=37),
        "cpu-row-wise-adagrad-weight-decay-ignored": ShardingCase(
            "ebc", world_size, sums, {"t0": ("table_wise", 0), "t1": ("table_wise", 0)},
            optimizer=OptimizerSpec("rowwise_adagrad", 0.1, eps=1e-3, weight_decay=0.1, weight_decay_mode="decouple"),
            steps=_steps(world_size, steps=1), seed=36),
    }

