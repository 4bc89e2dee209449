"""cw-stitch: a sharded EC/EBC (column-wise tables on ranks in any order, mixed with TW/RW/DP)
against the same module unsharded with the same weights.

On every rank: torchrec's per-feature CW permutation equals paritykit.stitching's; each output
feature (EC JaggedTensor: values, lengths, indices; EBC KeyedTensor column) equals the unsharded
module's on that rank's batch; after one backward and one SGD step the tables gathered from the
shards equal the unsharded module stepped on every rank's batch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from paritykit.checks.base import GateConfig, PoolProvider, run_property
from paritykit.errors import ParityError, UnsupportedByTorchrec
from paritykit.plan_strategies import ShardingCase, cw_cases
from paritykit.report import CaseResult

NAME = "cw-stitch"
LEARNING_RATE = 0.1


def _case_header(case: ShardingCase, rank: int) -> str:
    return f"cw-stitch {case.module} plan={_plan(case)} kernel={case.kernel} rank={rank}"


def _plan(case: ShardingCase) -> str:
    from paritykit.models import describe_plan

    return describe_plan(case.plan)


def _build_unsharded(case: ShardingCase, seed: int) -> torch.nn.Module:
    from paritykit.models import build_ebc, build_ec

    if case.module == "ec":
        return build_ec(case.tables, seed=seed, need_indices=case.need_indices)
    return build_ebc(case.tables, seed=seed, is_weighted=case.weighted)


def _local_kjt(case: ShardingCase, rank: int):
    from paritykit.models import feature_names_of, kjt_from_rows

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
    generator = torch.Generator().manual_seed(case.seed * 7919 + rank * 104729 + sum(map(ord, key)))
    return torch.randn(like.shape, generator=generator)


def _loss(case: ShardingCase, rank: int, outputs: dict[str, Any]) -> torch.Tensor:
    total = torch.zeros(())
    for key in sorted(outputs):
        values = outputs[key].values() if case.module == "ec" else outputs[key]
        total = total + (values * _upstream_gradient(case, rank, key, values)).sum()
    return total


def _first_difference(name: str, actual: Any, expected: Any, exact: bool) -> str | None:
    from paritykit.compare import find_differences, format_differences

    differences = find_differences(actual, expected, exact=exact, name=name)
    return format_differences(differences[:3], exact=exact) if differences else None


def _check_permutation(case: ShardingCase, sharded: torch.nn.Module) -> str | None:
    from paritykit.stitching import expected_feature_permute_indices

    if case.module != "ec":
        return None
    ours = expected_feature_permute_indices(case.tables, case.plan)
    theirs = {k: list(v) for k, v in sharded._features_to_permute_indices.items()}
    for feature in sorted(set(ours) | set(theirs)):
        if ours.get(feature) != theirs.get(feature):
            return (
                f"CW permutation for feature {feature!r}: torchrec computed {theirs.get(feature)}, "
                f"paritykit.stitching expects {ours.get(feature)}"
            )
    return None


def _reference_step(case: ShardingCase) -> dict[str, torch.Tensor]:
    """The unsharded module after one SGD step on every rank's batch (what the shards should hold)."""
    from paritykit.models import unsharded_full_weights

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
            table = name.split(".")[-2]
            scale = 1.0 / case.world_size if case.plan[table][0] == "data_parallel" else model_parallel_scale
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            stepped[table] = param.detach() - LEARNING_RATE * scale * grad
    full = unsharded_full_weights(reference)
    return {table: stepped.get(table, full[table]) for table in full}


def check_case_on_rank(case: ShardingCase) -> dict[str, Any]:
    """Runs on every rank of the pool. Raises ParityError naming the plan, kernel, feature and element."""
    import torch.distributed as dist

    from paritykit.models import copy_full_weights_into, gather_full_weights, seeded_full_weights, shard_module
    from paritykit.models import sgd_step_dense_parameters

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
    from paritykit.errors import HarnessError

    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    per_rank = pool.call(check_case_on_rank, (case,), case=case.describe())
    return {"plan_shape": case.plan_shape(), "ranks": len(per_rank), "features": per_rank[0]["features"]}


def examples_per_plan_shape(results: list[CaseResult]) -> Counter:
    """How many examples passed per plan shape (so a run cannot pass on nothing)."""
    return Counter(r.metrics.get("plan_shape", "?") for r in results if r.status == "pass")


# Two ranks' worth of rows with empty rows and an empty feature; larger worlds repeat them.
_PINNED_BATCHES = (
    {"f0": ((1, 2), (), (3,)), "f1": ((), (), ()), "f2": ((0,), (7, 7), ())},
    {"f0": ((4,), (5, 6), ()), "f1": ((1,), (), (2, 3)), "f2": ((), (), ())},
)


def pinned_cases(world_size: int, device: str) -> tuple[ShardingCase, ...]:
    """Cases every run covers before the random draws: the placements where stitching order and
    pooling mode show (random draws at a few examples may miss them).

    - EC, CW shards on ranks [0, 1, 0] (the seed commit's example: permute [0, 2, 1]);
    - EC, CW shards on ranks [1, 0, 0] (a 3-cycle: an inverted permutation differs from it);
    - EBC with MEAN pooling, CW on [1, 0] beside a table-wise table.
    """
    from paritykit.models import TableSpec
    from paritykit.plan_strategies import kernels_for

    batches = tuple(_PINNED_BATCHES[rank % 2] for rank in range(world_size))
    last = world_size - 1
    ec_tables = (TableSpec("t0", 10, 12, ("f0",)), TableSpec("t1", 7, 12, ("f1", "f0")), TableSpec("t2", 8, 12, ("f2",)))
    ebc_tables = (TableSpec("t0", 10, 8, ("f0",), "MEAN"), TableSpec("t1", 8, 12, ("f1", "f2"), "MEAN"))
    ec_kernel, ebc_kernel = kernels_for("ec", device)[0], kernels_for("ebc", device)[0]
    return (
        ShardingCase("ec", world_size, ec_tables, {"t0": ("column_wise", (0, last, 0)), "t1": ("table_wise", last), "t2": ("row_wise",)},
                     ec_kernel, need_indices=True, batches=batches, seed=5),
        ShardingCase("ec", world_size, ec_tables, {"t0": ("column_wise", (last, 0, 0)), "t1": ("table_wise", 0), "t2": ("row_wise",)},
                     ec_kernel, batches=batches, seed=6),
        ShardingCase("ebc", world_size, ebc_tables, {"t0": ("column_wise", (last, 0)), "t1": ("table_wise", 0)},
                     ebc_kernel, batches=batches, seed=7),
    )


def known_broken_cases(world_size: int, device: str) -> tuple[ShardingCase, ...]:
    """One case per combination listed in plan_strategies.BROKEN_ON_DEVICE for ``device``.

    They are run on purpose, outside the random draws, so that paritykit/known_issues.toml can mark
    their failures as known and `paritykit gate --strict` notices the day torchrec fixes them.
    """
    from paritykit.models import TableSpec
    from paritykit.plan_strategies import BROKEN_ON_DEVICE

    batches = tuple(_PINNED_BATCHES[rank % 2] for rank in range(world_size))
    tables = (TableSpec("t0", 10, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1", "f2")))
    cases = []
    for broken_device, module, name in BROKEN_ON_DEVICE:
        if broken_device != device or module != "ec":
            continue
        if name == "data_parallel":
            plan, kernel = {"t0": ("column_wise", (0, world_size - 1)), "t1": ("data_parallel",)}, "fused"
        else:
            plan, kernel = {"t0": ("column_wise", (0, world_size - 1)), "t1": ("table_wise", 0)}, name
        cases.append(ShardingCase("ec", world_size, tables, plan, kernel, batches=batches, seed=8))
    return tuple(cases)


def _known_broken_result(case: ShardingCase, pool: Any, config: GateConfig) -> CaseResult:
    import time

    from paritykit.checks.base import result_from_exception

    case_id = f"known-broken {case.describe()}"
    started = time.perf_counter()
    try:
        metrics = assert_sharded_matches_unsharded(case, pool)
    except Exception as exc:  # noqa: BLE001 - every outcome is reported, matched against known issues
        return result_from_exception(NAME, case_id, config.replay(NAME, case), exc, started)
    return CaseResult(NAME, case_id, "pass", replay=config.replay(NAME, case), metrics=metrics,
                      duration_s=time.perf_counter() - started)


def run(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    from paritykit.errors import HarnessError

    world_sizes = tuple(w for w in config.world_sizes if w >= 2) or (2,)
    results: list[CaseResult] = []
    known_broken: list[CaseResult] = []
    for world_size in world_sizes:
        pool = pools.get(world_size)
        strategy = cw_cases(world_sizes=(world_size,), device=config.device)
        results += run_property(
            NAME,
            strategy,
            lambda case, pool=pool: assert_sharded_matches_unsharded(case, pool),
            config,
            case_id=lambda case: case.describe(),
            explicit=pinned_cases(world_size, config.device),
        )
        known_broken += [_known_broken_result(case, pool, config) for case in known_broken_cases(world_size, config.device)]
    if not examples_per_plan_shape(results) and not any(r.status == "fail" for r in results):
        results.append(
            CaseResult(
                NAME, "<no examples>", "error", replay=config.replay(NAME),
                message=str(HarnessError("no cw-stitch example ran: every draw was rejected or unsupported")),
            )
        )
    return results + known_broken
