"""`paritykit gate --compare-to OLD/report.json`: what changed since the last release's gate.

Cases are matched by check and case id (a function of the seed and the arguments, so two gates
with the same arguments draw the same cases). Three lists:

- new failures: failing now (fail or error), not failing in the old report (passed there, or new);
- fixed known issues: a known issue in the old report that passes now;
- moved metrics: every number a case recorded in both reports that changed, e.g. the sync counts
  per budget, the SemiSync drift of the pipeline cases, the golden fixtures' distance to their goldens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from paritykit.checks.results import CaseResult

FAILING = ("fail", "error")


@dataclass(frozen=True)
class MovedMetric:
    check: str
    case_id: str
    metric: str
    old: float
    new: float

    @property
    def change(self) -> str:
        delta = self.new - self.old
        relative = f" ({delta / abs(self.old):+.2%})" if self.old and math.isfinite(delta) else ""
        return f"{self.old:.6g} -> {self.new:.6g}{relative}"


@dataclass
class Comparison:
    """What changed between the old report (``old_source``) and this run."""

    old_source: str
    old_environment: dict[str, Any] = field(default_factory=dict)
    new_failures: list[CaseResult] = field(default_factory=list)
    fixed_known_issues: list[CaseResult] = field(default_factory=list)
    moved_metrics: list[MovedMetric] = field(default_factory=list)
    cases_compared: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "old_source": self.old_source,
            "old_environment": self.old_environment,
            "cases_compared": self.cases_compared,
            "new_failures": [{"check": c.check, "case_id": c.case_id, "status": c.status} for c in self.new_failures],
            "fixed_known_issues": [{"check": c.check, "case_id": c.case_id} for c in self.fixed_known_issues],
            "moved_metrics": [asdict(m) for m in self.moved_metrics],
        }


def numeric_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in a (nested) metrics dict, by dotted path (``semi_sync.max_output_diff``, ``syncs_per_rank[1][0]``)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        _collect(value, f"{prefix}{key}", out)
    return out


def _collect(value: Any, path: str, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        out[path] = float(value)
    elif isinstance(value, dict):
        for key, inner in value.items():
            _collect(inner, f"{path}.{key}", out)
    elif isinstance(value, (list, tuple)):
        for index, inner in enumerate(value):
            _collect(inner, f"{path}[{index}]", out)


def _same(old: float, new: float) -> bool:
    return old == new or (math.isnan(old) and math.isnan(new))


def compare(old_cases: list[CaseResult], new_cases: list[CaseResult], old_source: str, old_environment: dict[str, Any]) -> Comparison:
    """The comparison section of this run's report against an old one."""
    old = {(c.check, c.case_id): c for c in old_cases}
    comparison = Comparison(old_source, old_environment)
    for case in new_cases:
        before = old.get((case.check, case.case_id))
        if case.status in FAILING and (before is None or before.status not in FAILING):
            comparison.new_failures.append(case)
        if before is None:
            continue
        comparison.cases_compared += 1
        if before.status == "known-issue" and case.status == "pass":
            comparison.fixed_known_issues.append(case)
        then, now = numeric_metrics(before.metrics), numeric_metrics(case.metrics)
        comparison.moved_metrics += [
            MovedMetric(case.check, case.case_id, name, then[name], now[name])
            for name in sorted(set(then) & set(now)) if not _same(then[name], now[name])
        ]
    return comparison


def render_markdown(comparison: Comparison) -> list[str]:
    """The report.md section."""
    out = [f"## Compared with {comparison.old_source}", ""]
    old_env = ", ".join(f"{k} {v}" for k, v in comparison.old_environment.items() if k in ("torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu"))
    out += [f"{comparison.cases_compared} cases in both reports" + (f"; the old one ran on {old_env}" if old_env else ""), ""]
    out += [f"### New failures ({len(comparison.new_failures)})", ""]
    out += [f"- [{c.status}] {c.check} :: `{c.short_id}` {c.case_id}" for c in comparison.new_failures] or ["none"]
    out += ["", f"### Fixed known issues ({len(comparison.fixed_known_issues)})", ""]
    out += [f"- {c.check} :: `{c.short_id}` {c.case_id}" for c in comparison.fixed_known_issues] or ["none"]
    out += ["", f"### Metrics that moved ({len(comparison.moved_metrics)})", ""]
    if comparison.moved_metrics:
        out += ["| check | case | metric | old -> new |", "| --- | --- | --- | --- |"]
        out += [f"| {m.check} | {_md(m.case_id)} | {m.metric} | {m.change} |" for m in comparison.moved_metrics]
    else:
        out.append("none")
    return out + [""]


def render_terminal(comparison: Comparison, limit: int = 20) -> list[str]:
    lines = [f"compared with {comparison.old_source} ({comparison.cases_compared} cases in both): "
             f"{len(comparison.new_failures)} new failures, {len(comparison.fixed_known_issues)} fixed known issues, "
             f"{len(comparison.moved_metrics)} metrics moved"]
    lines += [f"  new failure [{c.status}] {c.check} :: {c.case_id}" for c in comparison.new_failures[:limit]]
    lines += [f"  fixed known issue {c.check} :: {c.case_id}" for c in comparison.fixed_known_issues[:limit]]
    lines += [f"  moved {m.check} :: {m.case_id} {m.metric}: {m.change}" for m in comparison.moved_metrics[:limit]]
    hidden = len(comparison.moved_metrics) - limit
    if hidden > 0:
        lines.append(f"  ... and {hidden} more moved metrics (report.md lists them all)")
    return lines


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
