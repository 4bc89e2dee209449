"""One planner case: the plan torchrec's planner makes, held against the rules of plan_rules.py, its
own statistics report against report_rules.py and every option's estimates against estimate_rules.py
in the caller, then the model sharded by it trained against the unsharded module (the engine)."""

from __future__ import annotations

from typing import Any

from paritykit.checks.planner.cases import PlannerCase, batches_of, model_fn
from paritykit.checks.planner.plan_rules import plan_problems
from paritykit.checks.planner.planning import estimate_problems, plan_case
from paritykit.engine.comparison import compare_records, where_for
from paritykit.engine.reference import train_reference
from paritykit.engine.setup import build_setup
from paritykit.engine.tolerances import default_tolerance
from paritykit.engine.training import assemble_records, train_on_rank
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.sharded import gradient_division


def kernels_offered(module: str, device: str = "cpu") -> dict[str, tuple[str, ...]]:
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    sharder = EmbeddingCollectionSharder() if module == "ec" else EmbeddingBagCollectionSharder()
    return {kind: tuple(sharder.compute_kernels(kind, device)) for kind in sharder.sharding_types(device)}


def run_planner_case(case: PlannerCase, pool: Any) -> dict[str, Any]:
    """ParityError naming the table whose planned placement breaks a rule, or the step, rank, table
    and element where the planned model's training first differs from the unsharded module's."""
    if (pool.world_size, getattr(pool, "ranks_per_host", pool.world_size)) != (case.world_size, case.ranks_per_host):
        raise HarnessError(f"case needs {case.hosts.describe()}, the pool has {pool.world_size} ranks "
                           f"of {getattr(pool, 'ranks_per_host', pool.world_size)} per host")
    make = model_fn(case)
    plan, report_problems = plan_case(case, make(), pool.device)
    problems = plan_problems(case, plan, kernels_offered(case.module, pool.device), pool.device) + report_problems + estimate_problems(case)
    if pool.device != "cuda":
        # The same model planned for GPU ranks (planning needs no GPU): held to the same rules.
        problems += [f"planned for cuda: {p}" for p in _cuda_plan(case)[1]]
    if problems:
        raise ParityError(f"{case.describe()}\n  torchrec's planner broke the plan's rules:\n    " + "\n    ".join(problems))
    setup = build_setup(make, plan, batches_of(case), embedding_optimizer=case.optimizer, seed=case.seed,
                        device=pool.device, ranks_per_host=case.ranks_per_host)
    reference = train_reference(setup, division=gradient_division())
    record = assemble_records(pool.call(train_on_rank, (setup,), case=case.case_id()))
    metrics = compare_records(record, reference, default_tolerance(exact_first_lookups=case.module == "ec"),
                              case.describe(), where_for(setup))
    return {**metrics, "plan_shape": f"{case.module}/{case.hosts}/{_sharding_types(plan)}"}


def _cuda_plan(case: PlannerCase) -> tuple[Any, list[str]]:
    """The case planned for GPU ranks (planning needs no GPU) and every rule the plan or its report breaks."""
    plan, report = plan_case(case, model_fn(case)(), "cuda")
    return plan, plan_problems(case, plan, kernels_offered(case.module, "cuda"), "cuda") + report


def _sharding_types(plan: Any) -> str:
    """The plan's sharding types, one per table, sorted and joined: 'row_wise+table_wise'."""
    return "+".join(sorted(sharding.sharding_type for module_plan in plan.plan.values() for sharding in module_plan.values()))


def run_gpu_plan_case(case: PlannerCase) -> dict[str, Any]:
    """A case whose constraints name placements torchrec's sharders offer GPU ranks only (table-row-wise,
    grid, an EBC row-wise): planned for cuda (planning needs no GPU) and held to the plan's rules. It
    cannot train here."""
    plan, problems = _cuda_plan(case)
    if problems:
        raise ParityError(f"{case.describe()} planned for cuda\n  torchrec's planner broke the plan's rules:\n    " + "\n    ".join(problems))
    return {"tables": sum(len(module_plan) for module_plan in plan.plan.values()),
            "plan_shape": f"{case.module}/{case.hosts}/cuda/{_sharding_types(plan)}"}
