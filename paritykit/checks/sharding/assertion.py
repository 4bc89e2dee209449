"""cw-stitch: a sharded EC/EBC (column-wise tables on ranks in any order, mixed with TW/RW/DP)
against the same module unsharded with the same weights.

On every rank: torchrec's per-feature CW permutation equals paritykit's stitching.py; each output
feature (EC JaggedTensor: values, lengths, indices; EBC KeyedTensor column) equals the unsharded
module's on that rank's batch; after one backward and one SGD step the tables gathered from the
shards equal the unsharded module stepped on every rank's batch.
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.checks.sharding.cases import ShardingCase
from paritykit.checks.sharding.stitching import expected_feature_permute_indices
from paritykit.compare import find_differences, format_differences
from paritykit.errors import HarnessError, ParityError, UnsupportedByTorchrec
from paritykit.harness.plans import describe_plan
from paritykit.harness.seeding import generator
from paritykit.harness.sharded import copy_full_weights_into, gather_full_weights, sgd_step_dense_parameters, shard_module
from paritykit.harness.tables import (
    build_ebc,
    build_ec,
    feature_names_of,
    kjt_from_rows,
    seeded_full_weights,
    table_of_key,
    unsharded_full_weights,
)

LEARNING_RATE = 0.1


def _case_header(case: ShardingCase, rank: int) -> str:
    return f"cw-stitch {case.module} plan={_plan(case)} kernel={case.kernel} rank={rank}"


def _plan(case: ShardingCase) -> str:
    return describe_plan(case.plan)


def _build_unsharded(case: ShardingCase, seed: int) -> torch.nn.Module:
    if case.module == "ec":
        return build_ec(case.tables, seed=seed, need_indices=case.need_indices)
    return build_ebc(case.tables, seed=seed, is_weighted=case.weighted)


def _local_kjt(case: ShardingCase, rank: int):
    weights = case.weights[rank] if case.weights is not None else None
    return kjt_from_rows(feature_names_of(case.tables), case.batches[rank], weights)


def _outputs_by_key(case: ShardingCase, output: Any) -> dict[str, Any]:
    if hasattr(output, "wait") and not isinstance(output, dict):
        output = output.wait()
    if case.module == "ec":
        return dict(output)
    return {key: output[key] for key in output.keys()}


def _upstream_gradient(case: ShardingCase, rank: int, key: str, like: torch.Tensor) -> torch.Tensor:
    # A fixed pseudo-random upstream gradient per (rank, output key), so every element matters.
    return torch.randn(like.shape, generator=generator("upstream-gradient", case.seed, rank, key))


def _loss(case: ShardingCase, rank: int, outputs: dict[str, Any]) -> torch.Tensor:
    total = torch.zeros(())
    for key in sorted(outputs):
        values = outputs[key].values() if case.module == "ec" else outputs[key]
        total = total + (values * _upstream_gradient(case, rank, key, values)).sum()
    return total


def _first_difference(name: str, actual: Any, expected: Any, exact: bool) -> str | None:
    differences = find_differences(actual, expected, exact=exact, name=name)
    return format_differences(differences[:3], exact=exact) if differences else None


def _check_permutation(case: ShardingCase, sharded: torch.nn.Module) -> str | None:
    if case.module != "ec":
        return None
    ours = expected_feature_permute_indices(case.tables, case.plan)
    theirs = {k: list(v) for k, v in sharded._features_to_permute_indices.items()}
    for feature in sorted(set(ours) | set(theirs)):
        if ours.get(feature) != theirs.get(feature):
            return (
                f"CW permutation for feature {feature!r}: torchrec computed {theirs.get(feature)}, "
                f"paritykit's stitching.py expects {ours.get(feature)}"
            )
    return None


def _reference_step(case: ShardingCase) -> dict[str, torch.Tensor]:
    """The unsharded module after one SGD step on every rank's batch (what the shards should hold)."""
    reference = _build_unsharded(case, case.seed)
    loss = sum(_loss(case, r, _outputs_by_key(case, reference(_local_kjt(case, r)))) for r in range(case.world_size))
    loss.backward()
    from torchrec.distributed.comm_ops import get_gradient_division

    # Data-parallel replicas average gradients over ranks (DDP); model-parallel shards average
    # them too while torchrec's all-to-all gradient division is on (its default), else sum them.
    model_parallel_scale = 1.0 / case.world_size if get_gradient_division() else 1.0
    stepped = {}
    with torch.no_grad():
        for name, param in reference.named_parameters():
            table = table_of_key(name)
            scale = 1.0 / case.world_size if case.plan[table][0] == "data_parallel" else model_parallel_scale
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            stepped[table] = param.detach() - LEARNING_RATE * scale * grad
    full = unsharded_full_weights(reference)
    return {table: stepped.get(table, full[table]) for table in full}


def check_case_on_rank(case: ShardingCase) -> dict[str, Any]:
    """Runs on every rank of the pool. Raises ParityError naming the plan, kernel, feature and element."""
    import torch.distributed as dist


    rank = dist.get_rank()
    header = _case_header(case, rank)
    # Sharded from other weights, then overwritten: a copy that misses a shard cannot pass.
    try:
        sharded = shard_module(
            _build_unsharded(case, case.seed + 1), case.plan, device="cpu", compute_kernel=case.kernel,
            learning_rate=LEARNING_RATE,
        )
    except (ValueError, AssertionError, NotImplementedError) as exc:
        raise UnsupportedByTorchrec(f"{header}: torchrec refused to shard: {type(exc).__name__}: {exc}") from exc
    copy_full_weights_into(sharded, seeded_full_weights(case.tables, case.seed))
    reference = _build_unsharded(case, case.seed)

    # Collect the first problem but keep going, so every rank reaches the same collectives.
    problems: list[str] = []
    permutation_problem = _check_permutation(case, sharded)
    if permutation_problem:
        problems.append(permutation_problem)

    kjt = _local_kjt(case, rank)
    actual = _outputs_by_key(case, sharded(kjt))
    expected = _outputs_by_key(case, reference(kjt))
    if sorted(actual) != sorted(expected):
        problems.append(f"output keys {sorted(actual)} != unsharded {sorted(expected)}")
    for key in sorted(set(actual) & set(expected)):
        difference = _first_difference(f"output[{key!r}]", actual[key], expected[key], exact=case.module == "ec")
        if difference:
            problems.append(f"feature {key!r}: {difference}")
            break

    _loss(case, rank, actual).backward()
    sgd_step_dense_parameters(sharded, LEARNING_RATE)
    gathered = gather_full_weights(sharded)
    stepped = _reference_step(case)
    for table in sorted(stepped):
        difference = _first_difference(f"weights[{table!r}]", gathered[table], stepped[table], exact=False)
        if difference:
            problems.append(f"table {table!r} after one step: {difference}")
            break

    if problems:
        raise ParityError(f"{header}\n  " + "\n  ".join(problems) + f"\n  case: {case.describe()}")
    return {"features": len(expected), "tables": len(stepped)}


def assert_sharded_matches_unsharded(case: ShardingCase, pool: Any) -> dict[str, Any]:
    """Run ``case`` on ``pool`` (its world size must match); raises ParityError/RankFailure on a failure."""
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    per_rank = pool.call(check_case_on_rank, (case,), case=case.describe())
    return {"plan_shape": case.plan_shape(), "ranks": len(per_rank), "features": per_rank[0]["features"]}
