"""Checkpoint round trips that fail inside torchrec (or torch.distributed.checkpoint reading torchrec's
state dicts): kept out of the random draws, run on purpose as cases of their own (``known-broken
<rule> ...``) so that the known-issues file marks them and ``paritykit gate --strict`` notices the day
a release fixes one. Each rule says which cases it covers and how to change a drawn case to avoid it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from paritykit.checks import known_issues
from paritykit.checks.checkpoint.cases import CheckpointCase
from paritykit.harness.hosts import host_layout
from paritykit.harness.plans import local_world_size

# Optimizers that keep no state: torchrec's state dicts hold an empty dict where their state would be.
STATELESS = ("sgd",)


@dataclass(frozen=True)
class BrokenCombination:
    name: str
    applies: Callable[[CheckpointCase], bool]
    repair: Callable[[CheckpointCase], CheckpointCase]

    def kept_out(self) -> str | None:
        """Why the draws avoid this combination on the installed stack (None: its entry says it is fixed)."""
        return known_issues.rule_kept_out(self.name)


def holders(entry: tuple, world_size: int, ranks_per_host: int | None = None) -> set[int]:
    """The ranks that hold a shard of a table placed by ``entry`` on ``world_size`` ranks (hosts of
    ``ranks_per_host``; None: this launch's, else one host)."""
    kind = entry[0]
    if kind == "table_wise":
        return {entry[1]}
    if kind in ("column_wise", "table_column_wise"):
        return set(entry[1])
    if kind in ("table_row_wise", "grid_shard"):  # every rank of the hosts named
        hosts = host_layout(world_size, local_world_size(world_size, ranks_per_host))
        named = (entry[1],) if kind == "table_row_wise" else entry[1]
        return {rank for host in named for rank in hosts.ranks_of_host(host)}
    return set(range(world_size))


def _fused_tables(case: CheckpointCase) -> list[str]:
    return [t for t, e in case.reload_plan.items() if e[0] != "data_parallel" and case.kernel_of(t) == "fused"]


def _empty_state_on(case: CheckpointCase, rank: int) -> bool:
    """Whether an optimizer state dict this rank hands to dcp.load holds an empty dict, or a list (saved
    param groups): what DCP's pre-2.4 flattening keys differently (rule 1)."""
    if case.recipe.param_groups:
        return True
    held = [t for t in _fused_tables(case) if rank in holders(case.reload_plan[t], case.reload_world_size, case.ranks_per_host)]
    dense_params = any(case.kernel_of(t) == "dense" for t in case.reload_plan)
    fused_stateless, dense_stateless = case.optimizer in STATELESS, case.dense_optimizer in STATELESS
    if case.recipe.combined and dense_params:
        return bool(held) and fused_stateless or (not held and dense_stateless)
    return not held or fused_stateless or (dense_params and dense_stateless)


def _rank_missing_table_with_empty_state(case: CheckpointCase) -> bool:
    if case.recipe.method != "dcp":
        return False
    size = case.reload_world_size
    return any(any(rank not in holders(entry, size, case.ranks_per_host) for entry in case.reload_plan.values()) and _empty_state_on(case, rank)
               for rank in range(size))


def _stateful_optimizers(case: CheckpointCase) -> CheckpointCase:
    fused = "adagrad" if case.optimizer in STATELESS else case.optimizer
    dense = "adam" if case.dense_optimizer in STATELESS else case.dense_optimizer
    if (fused, dense) != (case.optimizer, case.dense_optimizer):
        return dataclasses.replace(case, optimizer=fused, dense_optimizer=dense)
    # Still broken (a rank holds no fused table): the checkpoint per rank, on the same plan.
    return _same_plan_per_rank(case)


def _same_plan_per_rank(case: CheckpointCase) -> CheckpointCase:
    steps = case.steps
    if case.reload_steps is not None:  # batches for the other world size: train the first ones again instead
        steps = case.steps[:case.save_after] + case.steps[:len(case.reload_steps)]
    return dataclasses.replace(case, reload_plan=dict(case.plan), reload_world_size=case.world_size, reload_steps=None,
                               steps=steps, recipe=dataclasses.replace(case.recipe, method="per_rank"))


def _dense_kernel_stateful_dcp(case: CheckpointCase) -> bool:
    dense_kernel = any(e[0] != "data_parallel" and case.kernel_of(t) == "dense" for t, e in case.plan.items())
    return case.recipe.method == "dcp" and dense_kernel and case.dense_optimizer not in STATELESS


def _dense_kernel_table_missing_on_a_rank(case: CheckpointCase) -> bool:
    if case.dense_optimizer in STATELESS:
        return False
    dense = [t for t, e in case.plan.items() if e[0] != "data_parallel" and case.kernel_of(t) == "dense"]
    return any(len(holders(plan[t], size, case.ranks_per_host)) < size for t in dense
               for plan, size in ((case.plan, case.world_size), (case.reload_plan, case.reload_world_size)))


def _all_fused(case: CheckpointCase) -> CheckpointCase:
    return dataclasses.replace(case, kernels={t: "fused" for t in case.plan})


def row_wise_state(optimizer: str) -> bool:
    """Whether a fused optimizer keeps state per row of each column block (fbgemm's row-wise family)."""
    return "rowwise" in optimizer


def _row_wise_blocks_change(case: CheckpointCase) -> bool:
    before, after = case.block_counts("plan"), case.block_counts("reload_plan")
    return row_wise_state(case.optimizer) and any(before[t] != after[t] for t in _fused_tables(case))


def _keep_blocks(case: CheckpointCase) -> CheckpointCase:
    before, after, plan = case.block_counts("plan"), case.block_counts("reload_plan"), dict(case.reload_plan)
    for table in _fused_tables(case):
        if before[table] != after[table]:
            count = before[table]
            plan[table] = ("row_wise",) if count == 1 else ("column_wise", tuple(r % case.reload_world_size for r in range(count)))
    return dataclasses.replace(case, reload_plan=plan)


def _per_rank_other_shards(case: CheckpointCase) -> bool:
    return case.recipe.method == "per_rank" and case.plan != case.reload_plan


def _every_rank_holds_every_fused_table(case: CheckpointCase, plan: dict[str, tuple], size: int) -> bool:
    fused = [t for t, e in plan.items() if e[0] != "data_parallel" and case.kernel_of(t) == "fused"]
    return all(len(holders(plan[t], size, case.ranks_per_host)) == size for t in fused)


def _dcp_param_groups_per_rank(case: CheckpointCase) -> bool:
    """Saved param groups are a rank's own list (its fused tables, grouped as its kernels are) under one
    key: only a reload into the same plan, where every rank holds every fused table, meets the copy DCP kept."""
    if case.recipe.method != "dcp" or not case.recipe.param_groups:
        return False
    same = case.plan == case.reload_plan and case.world_size == case.reload_world_size
    return not (same and _every_rank_holds_every_fused_table(case, case.plan, case.world_size))


def _combined_warmup(case: CheckpointCase) -> bool:
    return bool(case.recipe.warmup) and case.recipe.combined


RULES = (
    BrokenCombination("dcp-rank-without-a-table-and-empty-optimizer-state", _rank_missing_table_with_empty_state,
                      _stateful_optimizers),
    BrokenCombination("dcp-dense-kernel-optimizer-state", _dense_kernel_stateful_dcp, _all_fused),
    BrokenCombination("dense-kernel-table-missing-on-a-rank", _dense_kernel_table_missing_on_a_rank, _all_fused),
    BrokenCombination("row-wise-state-other-column-blocks", _row_wise_blocks_change, _keep_blocks),
    BrokenCombination("per-rank-load-other-shards", _per_rank_other_shards,
                      lambda case: dataclasses.replace(case, reload_plan=dict(case.plan))),
    BrokenCombination("dcp-param-groups-per-rank", _dcp_param_groups_per_rank,
                      lambda case: dataclasses.replace(case, recipe=dataclasses.replace(case.recipe, param_groups=False))),
    BrokenCombination("warmup-over-combined-optimizer", _combined_warmup,
                      lambda case: dataclasses.replace(case, recipe=dataclasses.replace(case.recipe, combined=False))),
)


def broken_rules(case: CheckpointCase, rules: tuple[BrokenCombination, ...] = RULES) -> list[BrokenCombination]:
    return [rule for rule in rules if rule.applies(case)]


def kept_out_rules() -> tuple[BrokenCombination, ...]:
    return tuple(rule for rule in RULES if rule.kept_out() is not None)


def repair(case: CheckpointCase, rules: tuple[BrokenCombination, ...] | None = None) -> CheckpointCase:
    """The drawn case changed just enough that no rule applies (a repair can make another rule apply:
    repeat until none does). By default the rules the installed stack keeps out."""
    rules = kept_out_rules() if rules is None else rules
    for _ in range(2 * len(rules) + 1):
        broken = broken_rules(case, rules)
        if not broken:
            return case
        case = broken[0].repair(case)
    raise AssertionError(f"the repairs of {[r.name for r in broken_rules(case, rules)]} undo each other")
