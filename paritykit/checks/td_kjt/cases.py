"""The td-kjt gate entry: eager TD/KJT parity (eager.py), then at each world size the sharded
three-way parity (sharded TD == sharded KJT == unsharded; rank.py) over pinned and drawn plans, the
pinned forward-only cases on layouts of several hosts (pinned.host_cases, ``config.pinned_host_layouts``), then the
configurations known to fail inside torchrec (known_broken.py), all on ``config.device``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_known_broken_case, run_property
from paritykit.checks.td_kjt.eager import (
    eager_case_id,
    eager_cases,
    pinned_eager_cases,
    run_eager_case,
)
from paritykit.checks.td_kjt.known_broken import (
    KJT_AFTER_TD,
    RW_MEAN_BESIDE_OTHERS,
    kjt_after_td_case,
    kjt_after_td_on_rank,
    rw_mean_beside_others_case,
    vbe_broken_cases,
)
from paritykit.checks.td_kjt.divergence import configuration_of
from paritykit.checks.td_kjt.pinned import host_cases, pinned_cases
from paritykit.checks.td_kjt.rank import check_case_on_rank
from paritykit.checks.td_kjt.sharded_draw import sharded_cases
from paritykit.checks.td_kjt.sharded_spec import ShardedCase
from paritykit.dist import PoolProvider
from paritykit.errors import HarnessError
from paritykit.harness.configuration import described_by

NAME = "td-kjt"


def run_sharded_case(pool: Any, case: ShardedCase) -> dict[str, Any]:
    """Run ``case`` on ``pool`` (of the case's world size); raises ParityError/RankFailure on a failure."""
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    with described_by(lambda exc: _failing_step(case, exc)):
        per_rank = pool.call(check_case_on_rank, (case,), case=case.describe())
    return {
        "plan_shape": case.plan_shape(),
        "world_size": len(per_rank),
        "output_elements": sum(r["output_elements"] for r in per_rank),
        "table_elements": sum(r["table_elements"] for r in per_rank),
    }


def _failing_step(case: ShardedCase, failure: BaseException) -> Any:
    """The configuration of the step the failure first diverged at (the check's steps are independent)."""
    divergence = getattr(failure, "divergence", None)
    return configuration_of(case, divergence.step if divergence is not None and divergence.step is not None else 0)


def run_kjt_after_td(pool: Any, case: ShardedCase) -> dict[str, Any]:
    feedings = replace(configuration_of(case), feedings=("kjt", "td", "kjt"), train=False)
    with described_by(lambda _exc: feedings):
        per_rank = pool.call(kjt_after_td_on_rank, (case,), case=f"{KJT_AFTER_TD}: {case.describe()}")
    return per_rank[0]


def known_broken_cases(world_size: int, device: str) -> list[tuple[str, ShardedCase]]:
    return [
        (KJT_AFTER_TD, kjt_after_td_case(world_size, device)),
        (RW_MEAN_BESIDE_OTHERS, rw_mean_beside_others_case(world_size, device)),
        *vbe_broken_cases(world_size, device),
    ]


def known_broken_results(pools: PoolProvider, config: GateConfig) -> list[CaseResult]:
    """Each known-broken case once, at the smallest of the config's world sizes where it applies (a
    case that fails on one rank while the others wait in a collective costs a pool restart).
    Every outcome is reported as it is; the gate matches the failures against the known issues."""
    results, done = [], set()
    for world_size in sorted(config.world_sizes):
        pool = pools.get(world_size)
        for label, case in known_broken_cases(world_size, config.device):
            if label in done:
                continue
            done.add(label)
            run = run_kjt_after_td if label == KJT_AFTER_TD else run_sharded_case
            results.append(run_known_broken_case(NAME, f"known-broken {label}: {case.describe()}", config, pool,
                                                 lambda run=run, pool=pool, case=case: run(pool, case)))
    return results


def run_matrix(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    """Eager parity, then sharded three-way parity at each of the config's world sizes."""
    results = run_property(NAME, eager_cases(), lambda case: run_eager_case(case, config.device), config,
                           case_id=eager_case_id, explicit=pinned_eager_cases())
    sharded: list[CaseResult] = []
    for world_size in config.world_sizes:
        pool = pools.get(world_size)
        sharded += run_property(
            NAME, sharded_cases(world_size, config.device), lambda case, pool=pool: run_sharded_case(pool, case),
            config, case_id=lambda case: case.describe(), explicit=pinned_cases(world_size, config.device),
        )
    for layout in config.pinned_host_layouts():
        pool = pools.get(layout.world_size, ranks_per_host=layout.ranks_per_host)
        sharded += [run_case(NAME, case.describe(), config, lambda case=case, pool=pool: run_sharded_case(pool, case))
                    for case in host_cases(layout.world_size, layout.ranks_per_host, config.device)]
    if config.world_sizes and not any(r.status in ("pass", "fail") for r in sharded):
        sharded.append(CaseResult(NAME, "<no sharded examples>", "error", replay=config.replay(NAME),
                                  message=str(HarnessError("no sharded td-kjt example ran"))))
    return results + sharded + known_broken_results(pools, config)
