"""The checkpoint check's gate entry: the pinned round trips at every world size, the drawn ones over
the world sizes asked for (saved on one, reloaded on any), and one case per known-broken rule."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from paritykit.checks.checkpoint.assertion import assert_checkpoint_roundtrip
from paritykit.checks.checkpoint.cases import CheckpointCase, roundtrip_arguments
from paritykit.checks.checkpoint.draws import EBC_PLACEMENTS, EC_PLACEMENTS, checkpoint_cases
from paritykit.checks.checkpoint.known_broken import RULES
from paritykit.checks.checkpoint.pinned import cross_host_cases, known_broken_cases, pinned_cases
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_known_broken_case, run_property
from paritykit.dist import PoolProvider
from paritykit.errors import HarnessError
from paritykit.harness.plans import implemented_placements

NAME = "checkpoint"
# A round trip costs two rank calls (DMP built twice, a checkpoint written and read) and three short
# reference runs: its median time was about seven sharding cases' in one gate run. The gate's
# --examples (50 by default) buys a quarter as many drawn round trips (docs/checkpoint.md, Cost).
EXAMPLES_PER_GATE_EXAMPLE = 0.25


@dataclass(frozen=True)
class ScaledExamples(GateConfig):
    """The config the drawn round trips run under: fewer examples, the same replay command (which
    scales again), so that ``--case`` finds the case among the same draws."""

    asked_examples: int = 0

    def replay(self, check: str, case_id: str | None = None) -> str:
        return GateConfig.replay(dataclasses.replace(self, examples=self.asked_examples), check, case_id)


def scaled(config: GateConfig) -> ScaledExamples:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(GateConfig)}
    return ScaledExamples(**{**fields, "examples": max(1, round(config.examples * EXAMPLES_PER_GATE_EXAMPLE))},
                          asked_examples=config.examples)


def run_case(case: CheckpointCase, pools: PoolProvider) -> dict[str, Any]:
    """One built-in case through the public assertion; metrics of what was compared."""
    args, kwargs = roundtrip_arguments(case)
    pool_for = lambda world_size: pools.get(world_size, ranks_per_host=case.ranks_per_host)  # noqa: E731
    return {**assert_checkpoint_roundtrip(*args, **kwargs, pool_for=pool_for), "plan_shape": case.plan_shape()}


def placements_by_module(device: str) -> dict[str, tuple[str, ...]]:
    return {
        "ebc": tuple(k for k in EBC_PLACEMENTS if k in implemented_placements("ebc", device)),
        "ec": tuple(k for k in EC_PLACEMENTS if k in implemented_placements("ec", device)),
    }


def run_matrix(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    world_sizes = tuple(dict.fromkeys(config.world_sizes)) or (1,)
    other = {size: next((s for s in world_sizes if s != size), None) for size in world_sizes}
    pinned = tuple(case for size in world_sizes for case in pinned_cases(size, other[size] if size == max(world_sizes) else None))
    kinds = placements_by_module(config.device)
    results = run_property(NAME, checkpoint_cases(world_sizes, kinds), lambda case: run_case(case, pools), scaled(config),
                           case_id=lambda case: case.case_id(), explicit=pinned)
    # Pools that stand for several hosts: grid and table-row-wise shards by host, CW across hosts.
    for hosts in (h for h in config.hosts if h.hosts > 1):
        results += run_property(NAME, checkpoint_cases((hosts.world_size,), kinds, hosts=hosts), lambda case: run_case(case, pools),
                                scaled(config), case_id=lambda case: case.case_id(), explicit=cross_host_cases(hosts))
    if not any(r.status == "pass" for r in results) and not any(r.status == "fail" for r in results):
        results.append(CaseResult(NAME, "<no examples>", "error", replay=config.replay(NAME),
                                  message=str(HarnessError("no checkpoint round trip ran: every draw was rejected or unsupported"))))
    # Each broken combination fails the same way at every world size of 2 or more: once, on the smallest.
    sizes = [size for size in world_sizes if size >= 2]
    for rule in RULES if sizes else ():
        case = known_broken_cases(min(sizes))[rule.name]
        results.append(run_known_broken_case(NAME, f"known-broken {rule.name} {case.case_id()}", config, pools.get(min(sizes)),
                                             lambda case=case: run_case(case, pools)))
    return results


def examples_per_plan_shape(results: list[CaseResult]) -> Counter:
    return Counter(r.metrics.get("plan_shape", "?") for r in results if r.status == "pass")
