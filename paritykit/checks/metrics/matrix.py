"""The metrics check's gate entry: each metric class over drawn streams (one or two tasks, fused and
unfused computation, windows), then the known-broken reproductions. Single-process: no pool."""

from __future__ import annotations

from typing import Any

from paritykit.checks.metrics.cases import run_metric_case
from paritykit.checks.metrics.known_broken import KNOWN_BROKEN
from paritykit.checks.metrics.specs import METRICS, metric_specs, pinned
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property

NAME = "metrics"
CPU_ONLY = "the metrics check computes on CPU in this version (the formulas are device-independent)"


def run_matrix(config: GateConfig, pools: Any = None) -> list[CaseResult]:
    if config.device != "cpu":
        return [CaseResult(NAME, "metrics", "skip", replay=config.replay(NAME), message=CPU_ONLY)]
    results: list[CaseResult] = []
    for metric in METRICS:
        results += run_property(NAME, metric_specs(metric), run_metric_case, config, case_id=lambda spec: spec.case_id(),
                                explicit=pinned(metric))
    for rule, (what, body) in KNOWN_BROKEN.items():
        results.append(run_case(NAME, f"known-broken {rule}: {what}", config, body))
    return results
