"""Run each planted bug against the check expected to catch it, and the clean stack for false alarms.

A plant is applied in the parent with ``paritykit.plants.applied`` and reaches every rank because the
rank pool sends the parent's active plants along with each call. "Caught" means the check reported
at least one failing case; an ``error`` (the harness could not run) is neither caught nor missed but
reported as such, so a broken plant cannot pass for a caught one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from paritykit import plants
from paritykit.checks import run_check
from paritykit.checks.base import GateConfig, PoolProvider
from paritykit.report import CaseResult


@dataclass
class PlantOutcome:
    plant: str
    check: str
    description: str
    verdict: str  # caught / missed / error
    seconds: float
    evidence: str


@dataclass
class CleanRun:
    check: str
    seed: int
    false_alarms: list[CaseResult]
    cases: int


def run_plant(name: str, config: GateConfig, pools: PoolProvider) -> PlantOutcome:
    check, description = plants.PLANT_INFO[name]
    started = time.perf_counter()
    with plants.applied([name]):
        results = run_check(check, config, pools)
    failed = [r for r in results if r.status == "fail"]
    errors = [r for r in results if r.status == "error"]
    if failed:
        verdict, evidence = "caught", _headline(failed[0])
    elif errors:
        verdict, evidence = "error", errors[0].message.splitlines()[0]
    else:
        verdict, evidence = "missed", f"{len(results)} cases passed"
    return PlantOutcome(name, check, description, verdict, time.perf_counter() - started, evidence[:160])


def _headline(case: CaseResult) -> str:
    """The line of a failure that says what differed: a located difference if there is one."""
    lines = [line.strip() for line in case.message.splitlines() if line.strip()]
    located = [line for line in lines if line.startswith(("[value]", "[structure]"))]
    return (located or lines or [case.case_id])[0]


def run_clean(check: str, config: GateConfig, pools: PoolProvider) -> CleanRun:
    results = run_check(check, config, pools)
    return CleanRun(check, config.seed, [r for r in results if r.status in ("fail", "error")], len(results))


def format_table(outcomes: list[PlantOutcome]) -> str:
    rows = [("planted bug", "expected catching check", "result", "time (s)", "evidence")]
    rows += [(o.plant, o.check, o.verdict, f"{o.seconds:.1f}", o.evidence) for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(widths[i]) if i < 4 else cell for i, cell in enumerate(row)) for row in rows]
    caught = sum(o.verdict == "caught" for o in outcomes)
    lines.append(f"kill rate: {caught}/{len(outcomes)}" + (f" ({100 * caught / len(outcomes):.0f}%)" if outcomes else ""))
    return "\n".join(lines)
