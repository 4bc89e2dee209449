"""One optimizer-wrapper case: the sharded model trained through torchrec's wrappers on the ranks,
against the unsharded model trained with torch's optimizers, torch's clipping and the hand-computed
schedule (engine/optim_reference.py).

Compared, in this order (the first divergence is the most telling): the learning rate every
optimizer trained each step with, as torchrec's param groups hold it, against the schedule; the
total gradient norm torchrec's clipping computed, against torch's over the same gradients; then
the per-step embeddings, outputs and losses, the final tables and dense parameters, and the dense
optimizers' keyed state (engine/comparison.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from paritykit.checks.optim.cases import OptimCase, batches_of, model_fn, torchrec_plan
from paritykit.engine.comparison import compare_records
from paritykit.engine.optim_reference import train_wrapped_reference
from paritykit.engine.optim_training import train_wrapped_on_rank
from paritykit.engine.setup import build_setup
from paritykit.engine.tolerances import default_tolerance, normwise
from paritykit.engine.training import TrainingRecord
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.sharded import gradient_division
from paritykit.harness.shards import assemble

# fbgemm keeps a fused optimizer's learning rate in float32 (a relative rounding of 6e-8); every
# schedule step and lr change in the cases moves it by 1% or more.
LR_RELATIVE = 1e-6


def optim_setup(case: OptimCase, device: str = "cpu"):
    return build_setup(model_fn(case), torchrec_plan(case), batches_of(case), embedding_optimizer=case.embedding_optimizer,
                       seed=case.seed, device=device)


def assemble_wrapped(per_rank: list[dict[str, Any]]) -> tuple[TrainingRecord, list[list[Any]], list[list[Any]]]:
    """(the record, norms[step][rank], lrs[step][rank]) from every rank's result."""
    steps = len(per_rank[0]["outputs"])
    record = TrainingRecord(
        outputs=[[r["outputs"][s] for r in per_rank] for s in range(steps)],
        losses=[[r["losses"][s] for r in per_rank] for s in range(steps)],
        embeddings=[[r["embeddings"][s] for r in per_rank] for s in range(steps)],
        state=assemble([r["state"] for r in per_rank], "sharded model state after the last step"),
        dense_state=assemble([r["dense_state"] for r in per_rank], "dense optimizers' keyed state"),
    )
    return record, [[r["norms"][s] for r in per_rank] for s in range(steps)], [[r["lrs"][s] for r in per_rank] for s in range(steps)]


def lr_problem(lrs: list[list[dict[str, float]]], expected: list[dict[str, float]]) -> str | None:
    """Each optimizer's lr on every rank that holds it (a rank without fused tables has no fused
    optimizer's groups); each optimizer must be on some rank."""
    for step, per_rank in enumerate(lrs):
        for name, want in expected[step].items():
            if not any(name in got for got in per_rank):
                return f"step {step}: torchrec's wrappers hand out no param group of optimizer {name!r} on any rank"
            for rank, got in enumerate(per_rank):
                have = got.get(name)
                if have is not None and not math.isclose(have, want, rel_tol=LR_RELATIVE):
                    return (f"step {step}, rank {rank}: optimizer {name!r} trained with lr {have!r} "
                            f"(torchrec's param groups), the schedule says {want!r}")
    return None


def norm_problem(norms: list[list[float | None]], expected: list[float | None]) -> str | None:
    bound = normwise(torch.float32)
    for step, per_rank in enumerate(norms):
        for rank, got in enumerate(per_rank):
            want = expected[step]
            if got is None or want is None:
                continue
            found = bound.differences(torch.tensor(got), torch.tensor(want), f"total gradient norm")
            if found:
                return (f"step {step}, rank {rank}: torchrec's clipping computed a total gradient norm of {got!r}, "
                        f"torch's clip_grad_norm_ over the same gradients {want!r} ({bound.describe()})")
    return None


def comparable_norms(case: OptimCase) -> bool:
    """VALUE and NONE track a rank's local norm unless the shards are mapped to their process groups:
    the whole model's only then, or where no rank holds a local shard."""
    clipping = case.wrapping.clipping
    if clipping is None:
        return False
    if clipping.mode == "value":
        return case.world_size == 1 or not case.model_parallel_dense_tables()
    return clipping.mode == "norm" or clipping.across_ranks or case.world_size == 1 or not case.model_parallel_dense_tables()


def clipped_steps(case: OptimCase, norms: list[float | None]) -> int:
    clipping = case.wrapping.clipping
    if clipping is None or clipping.mode != "norm":
        return 0
    return sum(1 for n in norms if n is not None and n > clipping.max_gradient)


def run_optim_case(case: OptimCase, pool: Any) -> dict[str, Any]:
    """ParityError naming step, rank and optimizer or state key; else what was compared."""
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    setup = optim_setup(case, pool.device)
    reference, extra = train_wrapped_reference(setup, case.wrapping, division=gradient_division())
    record, norms, lrs = assemble_wrapped(pool.call(train_wrapped_on_rank, (setup, case.wrapping), case=case.case_id()))
    problem = lr_problem(lrs, extra["lrs"])
    if problem is None and comparable_norms(case):
        problem = norm_problem(norms, extra["norms"])
    if problem:
        raise ParityError(f"{case.describe()}\n  {problem}")
    metrics = compare_records(record, reference, default_tolerance(), case.describe())
    compared_norms = sum(1 for per_rank in norms for n in per_rank if n is not None) if comparable_norms(case) else 0
    return {**metrics, "norms_compared": compared_norms, "clipped_steps": clipped_steps(case, extra["norms"]),
            "shape": shape_of(case)}


def shape_of(case: OptimCase) -> str:
    w = case.wrapping
    parts = [f"ws{case.world_size}", case.embedding_optimizer, "+".join(g.optimizer for g in w.dense)]
    parts += [w.clipping.mode] if w.clipping else []
    parts += ["warmup"] if w.warmup else []
    parts += ["resume"] if w.resume_at is not None else []
    return "/".join(parts)
