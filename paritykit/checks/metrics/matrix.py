"""The metrics check's gate entry: each metric class over drawn streams (one or two tasks, fused and
unfused computation, windows), on one rank and on the pools of the gate's world sizes (each rank its
own stream, compute() reducing them), then the known-broken reproductions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from paritykit.checks.metrics.cases import run_metric_case
from paritykit.checks.metrics.known_broken import KNOWN_BROKEN, KNOWN_BROKEN_ON_RANKS
from paritykit.checks.metrics.draws import metric_specs
from paritykit.checks.metrics.pinned import pinned, pinned_on_ranks
from paritykit.checks.metrics.specs import drawn_metrics
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property

NAME = "metrics"
# Every metric is pinned on a pool too: each state's reduction over the ranks (dist_reduce_fx: sums, means,
# gathered samples) shows only there, and the drawn property on a pool takes a fifth of the examples.
CPU_ONLY = "the metrics check computes on CPU in this version (the formulas are device-independent)"


def run_matrix(config: GateConfig, pools: Any = None) -> list[CaseResult]:
    if config.device != "cpu":
        return [CaseResult(NAME, "metrics", "skip", replay=config.replay(NAME), message=CPU_ONLY)]
    results: list[CaseResult] = []
    for metric in drawn_metrics():
        results += run_property(NAME, metric_specs(metric), run_metric_case, config, case_id=lambda spec: spec.case_id(),
                                explicit=pinned(metric))
    # On several ranks: each rank feeds its own stream; compute() reduces every rank's states. A case on
    # a pool costs a round trip to every rank: one property over every metric, a fifth of the examples.
    for world_size in (w for w in config.world_sizes if w > 1 and pools is not None):
        pool = pools.get(world_size)
        metrics = drawn_metrics(world_size)
        pinned_here = tuple(spec for metric in metrics for spec in pinned_on_ranks(metric, world_size))
        results += run_property(NAME, st.sampled_from(sorted(metrics)).flatmap(lambda metric: metric_specs(metric, world_size)),
                                lambda spec, pool=pool: run_metric_case(spec, pool),
                                replace(config, examples=max(1, config.examples // 5)), case_id=lambda spec: spec.case_id(),
                                explicit=pinned_here)
    for rule, (what, body) in KNOWN_BROKEN.items():
        results.append(run_case(NAME, f"known-broken {rule}: {what}", config, body))
    for rule, (what, spec) in KNOWN_BROKEN_ON_RANKS.items():
        pool = pools.get(spec.world_size) if pools is not None and spec.world_size in config.world_sizes else None
        if pool is None:
            results.append(CaseResult(NAME, f"known-broken {rule}: {what}", "skip", replay=config.replay(NAME),
                                      message=f"needs a pool of {spec.world_size} ranks (--world-size includes {spec.world_size})"))
            continue
        results.append(run_case(NAME, f"known-broken {rule}: {what}", config,
                                lambda spec=spec, pool=pool: run_metric_case(spec, pool)))
    return results
