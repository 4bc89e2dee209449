"""The sparse-ops check's gate entry: every op against its reference (pinned inputs, then drawn ones),
the ops under non-strict torch.export (pinned), the gradients, a sync budget per op, and the known-broken
reproductions.

Everything runs in the caller on CPU tensors, except the one known-broken case that can crash its
process, which runs on a rank of the pool (skipped, with the reason, when no pool is given).
"""

from __future__ import annotations

from typing import Any

from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_known_broken_case, run_property
from paritykit.checks.sparse_ops.budget import OpBudget, check_op_budget, functions_of, measure
from paritykit.checks.sparse_ops.cases import OpCase
from paritykit.checks.sparse_ops.embedding_cases import embedding_cases
from paritykit.checks.sparse_ops.grad_cases import grad_cases
from paritykit.checks.sparse_ops.jt_cases import jt_cases
from paritykit.checks.sparse_ops.kjt_cases import kjt_constructor_cases
from paritykit.checks.sparse_ops.equality_cases import equality_cases
from paritykit.checks.sparse_ops.export_cases import export_cases, run_export_case
from paritykit.checks.sparse_ops.kjt_dist_cases import kjt_dist_cases
from paritykit.checks.sparse_ops.kjt_op_cases import kjt_op_cases
from paritykit.checks.sparse_ops.known_broken import KNOWN_BROKEN, run_on_rank
from paritykit.checks.sparse_ops.kt_cases import kt_cases
from paritykit.checks.sparse_ops.op_budgets import op_budgets
from paritykit.checks.sparse_ops.validator_cases import validator_cases
from paritykit.dist.launcher import launched_by_torchrun

NAME = "sparse-ops"
CPU_ONLY = "the sparse-ops check builds its tensors on CPU in this version (the ops' CUDA kernels are not compared)"
NO_POOL = "needs a rank of the pool: the op can crash its process"
CRASH_POOL_WORLD_SIZE = 1


def op_cases() -> list[OpCase]:
    """Every op case, in gate order."""
    return (kjt_constructor_cases() + validator_cases() + kjt_op_cases() + kjt_dist_cases() + equality_cases() + jt_cases()
            + kt_cases() + embedding_cases() + grad_cases())


def run_op(case: OpCase, config: GateConfig) -> list[CaseResult]:
    return run_property(NAME, case.strategy, case.body, config, case_id=case.case_id, explicit=case.pinned)


def run_budget(budget: OpBudget, config: GateConfig) -> CaseResult:
    def body() -> dict[str, Any]:
        record = measure(budget, config.device)
        check_op_budget(budget, record)
        return {"syncs": record.total, "budget": budget.budget, "by_kind": record.by_kind, "by_function": dict(functions_of(record))}

    return run_case(NAME, f"budget {budget.name}", config, body)


def run_known_broken(config: GateConfig, pools: Any) -> list[CaseResult]:
    results = []
    for rule, (what, body) in KNOWN_BROKEN.items():
        case_id = f"known-broken {rule}: {what}"
        if body is not None:
            results.append(run_case(NAME, case_id, config, body))
        elif pools is None:
            results.append(CaseResult(NAME, case_id, "skip", replay=config.replay(NAME, case_id), message=NO_POOL))
        else:
            # One rank (no collective is involved): its crash restarts only that pool, never the
            # pools the other checks run on at their world sizes. Under torchrun the only ranks are
            # the launch's, and run_known_broken_case reports the case skipped there.
            pool = pools.get(min(config.world_sizes) if launched_by_torchrun() else CRASH_POOL_WORLD_SIZE)
            results.append(run_known_broken_case(NAME, case_id, config, pool, lambda pool=pool: run_on_rank(pool)))
    return results


def run_matrix(config: GateConfig, pools: Any = None) -> list[CaseResult]:
    if config.device != "cpu":
        return [CaseResult(NAME, "sparse ops", "skip", replay=config.replay(NAME), message=CPU_ONLY)]
    results: list[CaseResult] = []
    for case in op_cases():
        results += run_op(case, config)
    # The ops under non-strict torch.export: pinned only (an export costs about a second).
    results += [run_case(NAME, case.case_id(), config, lambda case=case: run_export_case(case)) for case in export_cases()]
    results += [run_budget(budget, config) for budget in op_budgets()]
    return results + run_known_broken(config, pools)
