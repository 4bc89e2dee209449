"""The metrics check's gate entry: each metric class over drawn streams (one or two tasks, fused and
unfused computation, windows), on one rank and on the pools of the gate's world sizes (each rank its
own stream, compute() reducing them), then the known-broken reproductions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from paritykit.checks.metrics.cases import run_metric_case
from paritykit.checks.metrics.known_broken import KNOWN_BROKEN
from paritykit.checks.metrics.specs import drawn_metrics, metric_specs, pinned, pinned_on_ranks
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property

NAME = "metrics"
# The metrics pinned on a pool: a ratio of sums (NE, calibration), a count (recall), the one that gathers
# samples rather than sums (AUC) and the one its ranks average (scalar); the drawn property covers every metric.
ON_RANKS_PINNED = ("ne", "calibration", "recall", "auc", "scalar")
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
        pinned_here = tuple(spec for metric in ON_RANKS_PINNED for spec in pinned_on_ranks(metric, world_size))
        results += run_property(NAME, st.sampled_from(sorted(drawn_metrics())).flatmap(lambda metric: metric_specs(metric, world_size)),
                                lambda spec, pool=pool: run_metric_case(spec, pool),
                                replace(config, examples=max(1, config.examples // 5)), case_id=lambda spec: spec.case_id(),
                                explicit=pinned_here)
    for rule, (what, body) in KNOWN_BROKEN.items():
        results.append(run_case(NAME, f"known-broken {rule}: {what}", config, body))
    return results
