"""One built-in ShardingCase through the same path as a user's model, plus the CW shard-order oracle."""

from __future__ import annotations

import dataclasses
from typing import Any

from paritykit.engine.setup import build_setup
from paritykit.checks.sharding.cases import ShardingCase, batches_of, configuration_of, expanded, model_fn, torchrec_plan
from paritykit.engine.comparison import compare_records, where_for
from paritykit.engine.reference import train_reference
from paritykit.checks.sharding.stitching import permutations_of_plan, sharded_cw_permutations
from paritykit.engine.tolerances import default_tolerance
from paritykit.engine.training import TrainingRecord, assemble_records, train_on_rank
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.configuration import described_by
from paritykit.harness.optimizers import OptimizerSpec
from paritykit.harness.sharded import gradient_division


def case_setup(case: ShardingCase, device: str = "cpu"):
    setup = build_setup(model_fn(case), torchrec_plan(case), batches_of(case), embedding_optimizer=case.optimizer,
                        dense_optimizer=case.dense_optimizer, seed=case.seed, device=device,
                        ranks_per_host=case.hosts.ranks_per_host)
    return dataclasses.replace(setup, probes=(sharded_cw_permutations,)) if case.module == "ec" else setup


def permutation_problem(case: ShardingCase, setup: Any, record: TrainingRecord) -> str | None:
    """torchrec's per-feature CW permutation, on every rank, against paritykit's own shard-order math."""
    if case.module != "ec":
        return None
    ours = permutations_of_plan(case.tables, setup.sharding_plan.plan[""])
    for rank, probes in enumerate(record.probes):
        theirs = probes[0].get("", {})
        for feature in sorted(set(ours) | set(theirs)):
            if ours.get(feature) != theirs.get(feature):
                return (f"rank {rank}: CW permutation for feature {feature!r}: torchrec computed {theirs.get(feature)}, "
                        f"paritykit's stitching.py expects {ours.get(feature)}")
    return None


def run_sharding_case(case: ShardingCase, pool: Any) -> dict[str, Any]:
    """ParityError naming step, rank, table or feature and element; else what was compared."""
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    if getattr(pool, "ranks_per_host", pool.world_size) != case.hosts.ranks_per_host:
        raise HarnessError(f"case needs {case.hosts.describe()}, the pool stands for "
                           f"{pool.world_size // pool.ranks_per_host} host(s) of {pool.ranks_per_host} ranks")
    with described_by(lambda _exc: configuration_of(case, pool.device)):
        return _run(case, pool)


def _run(case: ShardingCase, pool: Any) -> dict[str, Any]:
    setup = case_setup(case, pool.device)
    reference = train_reference(setup, division=gradient_division())
    record = assemble_records(pool.call(train_on_rank, (setup,), case=case.case_id()))
    problem = permutation_problem(case, setup, record)
    if problem:
        raise ParityError(f"{case.describe()}\n  {problem}")
    tolerance = default_tolerance(exact_first_lookups=case.module == "ec")
    metrics = compare_records(record, reference, tolerance, case.describe(), where_for(setup))
    dense = dense_equivalent(case)
    if dense is not None:
        # A second oracle that never sees inverse indices: the unsharded module trained on the fixed
        # batches the variable ones stand for (the rows expanded by hand), so a wrong expansion that
        # the sharded and the unsharded module share in torchrec cannot hide.
        dense_setup = case_setup(dense, pool.device)
        dense_reference = train_reference(dense_setup, division=gradient_division())
        steps = len(record.outputs) if not lookups_counted(case.optimizer) else 1
        compare_records(first_steps(record, steps), first_steps(dense_reference, steps), tolerance,
                        f"{case.describe()} [oracle: the rows expanded by hand]", where_for(dense_setup))
        metrics = {**metrics, "dense_equivalent_steps": steps}
    return {**metrics, "plan_shape": case.plan_shape()}


def lookups_counted(optimizer: Any) -> bool:
    """Whether the fused optimizer's update depends on how often a row was looked up, not only on its
    summed gradient (counter-based weight decay, RMSprop's iterations, EMA: fbgemm counts lookups): a
    fixed batch that repeats a row then trains otherwise than the variable batch that reads it once."""
    spec = OptimizerSpec.of(optimizer)
    if spec.name in ("sgd", "adagrad"):
        return False
    return spec.name != "rowwise_adagrad" or spec.kwargs.get("weight_decay_mode", "none") not in (None, "none")


def first_steps(record: TrainingRecord, steps: int) -> TrainingRecord:
    """The record's first ``steps`` steps; with fewer steps than it has, not the state after the last."""
    if steps >= len(record.outputs):
        return record
    return dataclasses.replace(record, outputs=record.outputs[:steps], losses=record.losses[:steps],
                               embeddings=record.embeddings[:steps], state={}, fused_state={}, dense_state={}, step_states=[])


def dense_equivalent(case: ShardingCase) -> ShardingCase | None:
    """The case with every variable batch expanded to the fixed batch it stands for (None: no variable batch)."""
    if not any(batch.inverse is not None for step in case.step_batches() for batch in step):
        return None
    return dataclasses.replace(case, steps=tuple(tuple(expanded(b) for b in step) for step in case.step_batches()), batches=(), weights=None)
