"""Combinations that fail inside torchrec: kept out of the random draws, run on purpose as cases of
their own (``known-broken <rule> ...``) so that the known-issues file marks them and
``paritykit gate --strict`` notices the day a release fixes one.

Each rule says which cases it covers and how to change a drawn case so that it avoids the rule.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from paritykit.checks import known_configurations, known_issues
from paritykit.checks.sharding.cases import RankBatch, ShardingCase, configuration_of
from paritykit.checks.sharding.optimizer_draws import (ec_with_explicit_fused_type, one_row_shard_with_row_states,
                                                       optimizer_known_broken_cases, uses_cpu_ignored_weight_decay,
                                                       with_class_derived_type, with_counter_weight_decay,
                                                       with_two_rows_per_shard)
from paritykit.harness.configuration import ShardedConfiguration
from paritykit.harness.plans import (ROW_WISE_FAMILY, ROW_WISE_KINDS, ebc_row_wise_mean_beside_others, has_shard_without_rows,
                                     with_rows_for_every_rank)
from paritykit.harness.tables import TableSpec


@dataclass(frozen=True)
class BrokenCombination:
    name: str
    why: str
    applies: Callable[[ShardingCase], bool]
    repair: Callable[[ShardingCase], ShardingCase]
    # How its known-issues entry names it: (device, module, kernel or sharding type) where other checks
    # draw the same pair, else the rule's own name.
    draws: tuple[str, str, str] | None = None

    def kept_out(self) -> str | None:
        """Why the draws avoid this combination on the installed stack (None: its entry says it is fixed)."""
        if self.draws is not None:
            return known_issues.kept_out_of_draws(*self.draws)
        return known_issues.rule_kept_out(self.name)


def _rw_shared_feature_mixed_pooling(case: ShardingCase) -> bool:
    if case.module != "ebc":
        return False
    poolings: dict[str, set[str]] = {}
    for table in case.tables:
        if case.plan[table.name][0] in ROW_WISE_KINDS:
            for feature in table.feature_names:
                poolings.setdefault(feature, set()).add(table.pooling)
    return any(len(kinds) > 1 for kinds in poolings.values())


def _with_pooling(case: ShardingCase, which: Callable[[TableSpec], bool], pooling: str) -> ShardingCase:
    tables = tuple(dataclasses.replace(t, pooling=pooling) if which(t) else t for t in case.tables)
    return dataclasses.replace(case, tables=tables)


def _grid_mean(case: ShardingCase) -> bool:
    return case.module == "ebc" and any(case.plan[t.name][0] == "grid_shard" and t.pooling == "MEAN" for t in case.tables)


def _vbe(case: ShardingCase) -> bool:
    return any(batch.inverse is not None for step in case.step_batches() for batch in step)


def _grid_vbe(case: ShardingCase) -> bool:
    return case.module == "ebc" and _vbe(case) and any(e[0] == "grid_shard" for e in case.plan.values())


def _batch_sizes(batch: RankBatch) -> tuple[int, ...]:
    """Rows per feature, then the output rows of a variable batch."""
    rows = tuple(len(rows) for _, rows in batch.ids)
    return rows + ((len(batch.inverse[0][1]),) if batch.inverse else ())


def _uneven_row_wise(case: ShardingCase) -> bool:
    # Its backward fails: a forward-only configuration (td-kjt's host cases) computes, and a failure there is news.
    uneven = any(len({_batch_sizes(b) for b in step}) > 1 for step in case.step_batches())
    return uneven and any(e[0] in ROW_WISE_FAMILY for e in case.plan.values()) and getattr(case, "train", True)


def _vbe_dense(case: ShardingCase) -> bool:
    return case.module == "ebc" and _vbe(case) and any(case.kernel_of(t) == "dense" for t in case.plan)


def _all_fused_no_dp(case: ShardingCase) -> ShardingCase:
    plan = {t: (("table_wise", 0) if e[0] == "data_parallel" else e) for t, e in case.plan.items()}
    return dataclasses.replace(case, plan=plan, kernel="fused", kernels={t: "fused" for t in case.plan})


def _vbe_mixed_pooling(case: ShardingCase) -> bool:
    return case.module == "ebc" and _vbe(case) and len({t.pooling for t in case.tables}) > 1


def _empty_row_shard(case: ShardingCase) -> bool:
    return has_shard_without_rows(case.tables, case.plan, case.world_size)


def _rows_for_every_rank(case: ShardingCase) -> ShardingCase:
    return dataclasses.replace(case, tables=with_rows_for_every_rank(case.tables, case.plan, case.world_size))


def _ec_data_parallel(case: ShardingCase) -> bool:
    return case.module == "ec" and any(entry[0] == "data_parallel" for entry in case.plan.values())


def _ec_uneven_column_widths(case: ShardingCase) -> bool:
    return case.module == "ec" and any(e[0] == "column_wise_sized" and len(set(e[1])) > 1 for e in case.plan.values())


def _ec_dense(case: ShardingCase) -> bool:
    return case.module == "ec" and any(case.kernel_of(t) == "dense" for t in case.plan if case.plan[t][0] != "data_parallel")


RULES = (
    BrokenCombination(
        "row-wise-family-uneven-batch",
        "a row-wise, table-row-wise or grid-sharded table with different batch sizes on the ranks (a feature's "
        "rows, or a variable batch's) fails in the backward of its reduce-scatter on gloo (allgather of tensors "
        "of different sizes)",
        _uneven_row_wise,
        lambda case: case,  # the draws give every rank one batch size when the plan has such a table
    ),
    BrokenCombination(
        "ebc-grid-variable-batch",
        "a grid-sharded EBC table fed a variable batch per feature fails in its output reduce-scatter "
        "(IndexError: the grid output dist handles differing batch sizes per rank, not per feature)",
        _grid_vbe,
        lambda case: dataclasses.replace(case, plan={t: (("table_wise", 0) if e[0] == "grid_shard" else e) for t, e in case.plan.items()}),
    ),
    BrokenCombination(
        "row-wise-shard-without-rows",
        "a row-wise, table-row-wise or grid-sharded table with fewer rows than ranks leaves a rank an empty shard, "
        "which fbgemm's CPU kernel refuses (weights[0] must be a GPU or MTIA tensor)",
        _empty_row_shard,
        _rows_for_every_rank,
    ),
    BrokenCombination(
        "ebc-variable-batch-mixed-pooling",
        "a sharded EBC fed a variable batch per feature, with SUM and MEAN tables (two batched kernels on a "
        "rank), merges their outputs into a pre-allocated tensor that fbgemm's CPU kernel refuses",
        _vbe_mixed_pooling,
        # SUM everywhere: the one repair no other rule undoes.
        lambda case: _with_pooling(case, lambda t: True, "SUM"),
    ),
    BrokenCombination(
        "ebc-variable-batch-dense-kernel",
        "a sharded EBC fed a variable batch per feature fails when a table uses the dense kernel (data-parallel "
        "tables always do): its output split expects one row per sample",
        _vbe_dense,
        _all_fused_no_dp,
    ),
    BrokenCombination(
        "ebc-row-wise-mean-beside-other-placements",
        "a sharded EBC with a row-wise or table-row-wise MEAN table divides the pooled embeddings of its other "
        "(table-wise, column-wise, data-parallel) features by their lengths too (_create_mean_pooling_divisor "
        "resets the divisor only for row-wise SUM features)",
        ebc_row_wise_mean_beside_others,
        lambda case: _with_pooling(case, lambda t: case.plan[t.name][0] in ROW_WISE_KINDS, "SUM"),
    ),
    BrokenCombination(
        "ebc-row-wise-shared-feature-mixed-pooling",
        "a feature read by a row-wise MEAN table and a row-wise SUM table of one EBC gets one divisor for both "
        "pooled outputs (_create_mean_pooling_divisor keys the divisor by feature, not by feature and table)",
        _rw_shared_feature_mixed_pooling,
        lambda case: _with_pooling(case, lambda t: case.plan[t.name][0] in ROW_WISE_KINDS, "SUM"),
    ),
    BrokenCombination(
        "ebc-grid-mean",
        "a grid-sharded EBC table with MEAN pooling averages each row shard's ids separately and then sums "
        "the shards (the mean-pooling callback covers row-wise and table-row-wise tables only)",
        _grid_mean,
        lambda case: _with_pooling(case, lambda t: case.plan[t.name][0] == "grid_shard", "SUM"),
    ),
    BrokenCombination(
        "ec-data-parallel",
        "a data-parallel table in a sharded EmbeddingCollection returns pooled rows (its output split fails)",
        _ec_data_parallel,
        lambda case: dataclasses.replace(case, plan={t: (("table_wise", 0) if e[0] == "data_parallel" else e) for t, e in case.plan.items()}),
        draws=("cpu", "ec", "data_parallel"),
    ),
    BrokenCombination(
        "ec-column-wise-uneven-widths",
        "a sharded EmbeddingCollection with column-wise shards of unequal widths (torchrec's column_wise(size_per_rank=...)) "
        "fails in its output all-to-all (split sizes do not match), while an EBC trains with the same shards",
        _ec_uneven_column_widths,
        lambda case: dataclasses.replace(case, plan={t: (("table_wise", 0) if e[0] == "column_wise_sized" else e) for t, e in case.plan.items()}),
    ),
    BrokenCombination(
        "ec-dense-kernel",
        "a sharded EmbeddingCollection with the dense kernel on CPU fails in its output split (split sizes do not match)",
        _ec_dense,
        lambda case: dataclasses.replace(case, kernel="fused", kernels={t: "fused" for t in case.plan}),
        draws=("cpu", "ec", "dense"),
    ),
    BrokenCombination(
        "ec-fused-optimizer-type-ignored",
        "a sharded EmbeddingCollection trains with the fused optimizer of the class given to apply_optimizer_in_backward "
        "even when its keyword arguments name another (optimizer=EmbOptimType...: EMA in-place row-wise Adagrad, row-wise "
        "RMSprop); the EmbeddingBagCollection sharder honours it",
        ec_with_explicit_fused_type,
        with_class_derived_type,
    ),
    BrokenCombination(
        "cpu-row-wise-adagrad-weight-decay-ignored",
        "fbgemm's CPU row-wise Adagrad kernel applies no weight decay in modes L2 and DECOUPLE (weights and accumulator "
        "are those of weight_decay=0); the counter-based mode applies it",
        uses_cpu_ignored_weight_decay,
        with_counter_weight_decay,
    ),
    BrokenCombination(
        "one-row-shard-row-states-as-single-values",
        "a row shard of one row trained by an optimizer with per-row states besides momentum1 (counter-based "
        "row-wise Adagrad: prev_iter, row_counter; row-wise RMSprop with adaptive regularization: prev_iter): "
        "torchrec's fused optimizer takes the one-element state for a single-value state and gives it the "
        "global metadata of one value per rank, so the saved state overlaps another shard's rows",
        one_row_shard_with_row_states,
        with_two_rows_per_shard,
    ),
)


def broken_rules(case: ShardingCase, rules: tuple[BrokenCombination, ...] = RULES) -> list[BrokenCombination]:
    return [rule for rule in rules if rule.applies(case)]


def kept_out_rules() -> tuple[BrokenCombination, ...]:
    """The rules the draws avoid on the installed stack: those whose known issue is not fixed here."""
    return tuple(rule for rule in RULES if rule.kept_out() is not None)


def repair(case: ShardingCase, rules: tuple[BrokenCombination, ...] | None = None) -> ShardingCase:
    """The drawn case changed just enough that no rule applies (one repair can make another rule
    apply, so repeat until none does). By default the rules the installed stack keeps out."""
    rules = kept_out_rules() if rules is None else rules
    for _ in range(len(rules) + 1):
        broken = broken_rules(case, rules)
        if not broken:
            return case
        case = broken[0].repair(case)
    raise AssertionError(f"the repairs of {[r.name for r in broken_rules(case, rules)]} undo each other")


_ROWS_RANK0 = (("f0", ((1, 2), (), (3,))), ("f1", ((), (1,), (2, 3))), ("f2", ((0,), (5, 5), ())))
_ROWS_RANK1 = (("f0", ((4,), (5, 6), ())), ("f1", ((1,), (), ())), ("f2", ((), (), (7,))))


def _steps(world_size: int, steps: int = 3) -> tuple[tuple[RankBatch, ...], ...]:
    batches = (RankBatch(_ROWS_RANK0), RankBatch(_ROWS_RANK1))
    return tuple(tuple(batches[(rank + step) % 2] for rank in range(world_size)) for step in range(steps))


def _vbe_steps(world_size: int) -> tuple[tuple[RankBatch, ...], ...]:
    ids = (("f0", ((1,), (2, 3))), ("f1", ((4, 5, 6),)), ("f2", ((), (7,))))
    inverse = (("f0", (1, 0, 1)), ("f1", (0, 0, 0)), ("f2", (0, 1, 1)))
    return (tuple(RankBatch(ids, None, inverse) for _ in range(world_size)),)


# Rules that need more than one rank to show (ranks with different batch sizes).
MIN_WORLD_SIZE = {"row-wise-family-uneven-batch": 2, "ec-column-wise-uneven-widths": 2, "row-wise-shard-without-rows": 2, "ebc-grid-variable-batch": 2,
                  "one-row-shard-row-states-as-single-values": 2}


def known_broken_cases(world_size: int) -> dict[str, ShardingCase]:
    """One small case per rule, that fails the way the rule says (rule name -> case). One step: each
    fails at its first forward."""
    last = world_size - 1
    ebc_tables = (TableSpec("t0", 10, 8, ("f0",), "MEAN"), TableSpec("t1", 8, 8, ("f1", "f2"), "SUM"))
    ec_tables = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2")))
    steps = _steps(world_size, steps=1)
    uneven = tuple(tuple(RankBatch(_ROWS_RANK0[:2] if rank == 0 else tuple((k, rows[:1]) for k, rows in _ROWS_RANK1[:2]))
                         for rank in range(world_size)) for _ in range(1))
    return {
        "row-wise-family-uneven-batch": ShardingCase(
            "ebc", world_size, (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1",))),
            {"t0": ("row_wise",), "t1": ("table_wise", 0)}, steps=uneven, seed=19),
        "ebc-grid-variable-batch": ShardingCase(
            "ebc", world_size, (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2"))),
            {"t0": ("grid_shard", (0,)), "t1": ("table_wise", 0)}, steps=_vbe_steps(world_size), seed=20),
        "row-wise-shard-without-rows": ShardingCase(
            "ebc", world_size, (TableSpec("t0", 1, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1",))),
            {"t0": ("row_wise",), "t1": ("table_wise", 0)},
            steps=(tuple(RankBatch((("f0", ((0,), ())), ("f1", ((1,), (2,))))) for _ in range(world_size)),), seed=18),
        "ebc-variable-batch-mixed-pooling": ShardingCase(
            "ebc", world_size, (TableSpec("t0", 10, 8, ("f0",), "MEAN"), TableSpec("t1", 8, 8, ("f1", "f2"))),
            {"t0": ("table_wise", 0), "t1": ("table_wise", 0)}, steps=_vbe_steps(world_size), seed=26),
        "ebc-variable-batch-dense-kernel": ShardingCase(
            "ebc", world_size, (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2"))),
            {"t0": ("data_parallel",), "t1": ("table_wise", 0)}, steps=_vbe_steps(world_size), seed=25),
        "ebc-row-wise-mean-beside-other-placements": ShardingCase(
            "ebc", world_size, ebc_tables, {"t0": ("row_wise",), "t1": ("table_wise", last)}, steps=steps, seed=21),
        "ebc-row-wise-shared-feature-mixed-pooling": ShardingCase(
            "ebc", world_size, (TableSpec("t0", 10, 8, ("f0",), "MEAN"), TableSpec("t1", 8, 8, ("f0", "f1"), "SUM")),
            {"t0": ("row_wise",), "t1": ("row_wise",)}, steps=steps, seed=27),
        "ebc-grid-mean": ShardingCase(
            "ebc", world_size, ebc_tables, {"t0": ("grid_shard", (0,)), "t1": ("grid_shard", (0,))}, steps=steps, seed=22),
        "ec-data-parallel": ShardingCase(
            "ec", world_size, ec_tables, {"t0": ("column_wise", (0, last)), "t1": ("data_parallel",)}, steps=steps, seed=23),
        "ec-column-wise-uneven-widths": ShardingCase(
            "ec", world_size, (TableSpec("t0", 10, 12, ("f0",)), TableSpec("t1", 8, 12, ("f1", "f2"))),
            {"t0": ("column_wise_sized", (4, 8)), "t1": ("table_wise", last)}, steps=steps, seed=28),
        "ec-dense-kernel": ShardingCase(
            "ec", world_size, ec_tables, {"t0": ("column_wise", (0, last)), "t1": ("table_wise", 0)}, kernel="dense",
            steps=steps, seed=24),
        **optimizer_known_broken_cases(world_size),
    }


# Rules seen in fbgemm's CPU kernels or gloo's collectives: a configuration matches them on CPU only.
CPU_ONLY = ("row-wise-family-uneven-batch", "row-wise-shard-without-rows", "ebc-variable-batch-mixed-pooling",
            "ec-data-parallel", "ec-dense-kernel")


def _reproduction(name: str) -> ShardedConfiguration:
    """The rule's known-broken case at the smallest world size that shows it."""
    return configuration_of(known_broken_cases(MIN_WORLD_SIZE.get(name, 1))[name])


def _on_cpu(applies: Callable[[ShardingCase], bool]) -> Callable[[ShardedConfiguration], bool]:
    return lambda config: config.device == "cpu" and applies(config)


# Rules about an optimizer's hyper-parameters: a ShardedConfiguration names its optimizer only (the
# reproductions build torch's and fbgemm's defaults), so these are matched in the gate's cases alone.
HYPER_PARAMETER_RULES = ("ec-fused-optimizer-type-ignored", "cpu-row-wise-adagrad-weight-decay-ignored",
                         "one-row-shard-row-states-as-single-values")

for _rule in RULES:
    if _rule.name in HYPER_PARAMETER_RULES:
        continue
    known_configurations.register(_rule.name, "sharding", _on_cpu(_rule.applies) if _rule.name in CPU_ONLY else _rule.applies,
                                  functools.partial(_reproduction, _rule.name))
