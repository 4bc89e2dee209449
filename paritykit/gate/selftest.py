"""`paritykit selftest`: each planted bug against the check expected to catch it, and the clean
stack for false alarms.

The plants live with their checks (``paritykit/checks/<check>/plants.py``) and are found through
the check registry. A plant is applied in the parent with ``paritykit.harness.plants.applied`` and
reaches every rank because each call carries the caller's active plants.

A plant is caught only when its run fails in a way the clean run of the same check, on the same
stack, configuration and seed, does not: a failing case whose id (or whose failure) the clean run
does not have. A plant whose failures the clean run has too is "not caught (the clean run fails the
same way)": a stack that crashes everywhere kills nothing. An ``error`` (the harness could not run)
is neither caught nor missed but reported as such, so a broken plant cannot pass for a caught one.
A planted run stops at its first failure the clean run lacks (``runner.stop_once``); the whole check
runs again only when the known issues then excuse that failure.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass

from paritykit.checks import CHECK_PACKAGES, load_plants
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import DEFAULT_HOSTS, GateConfig, stop_once
from paritykit.dist import PoolProvider
from paritykit.errors import HarnessError
from paritykit.gate.gating import run_checks
from paritykit.harness import plants


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
    results: list[CaseResult]

    @property
    def false_alarms(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in ("fail", "error")]

    @property
    def cases(self) -> int:
        return len(self.results)


NOT_CAUGHT_SAME_WAY = "not caught (the clean run fails the same way)"


def failure_signature(case: CaseResult) -> tuple[str, str]:
    """(case id, what failed), with the numbers that vary between runs (call ids, pids) left out."""
    return case.case_id, re.sub(r"\d+", "N", _headline(case))


def run_plant(name: str, config: GateConfig, pools: PoolProvider, clean: "CleanRun | None" = None) -> PlantOutcome:
    """The plant's run of its check, judged against the clean run of the same check and config
    (run here when not given)."""
    plant = plants.PLANTS[name]
    check, description = plant.check, plant.description
    clean = clean or run_clean(check, config, pools)
    started = time.perf_counter()
    clean_failures = {failure_signature(r) for r in clean.results if r.status == "fail"}
    # The run stops at its first failure the clean run lacks; should the known issues then excuse it,
    # the whole check runs again, so the verdict is always a whole run's.
    with plants.applied([name]), stop_once(lambda r: r.status == "fail" and failure_signature(r) not in clean_failures) as run:
        results, _ = run_checks([check], config, pools)
    if run.hit and not _new_failures(results, clean_failures):
        with plants.applied([name]):
            results, _ = run_checks([check], config, pools)
    failed = [r for r in results if r.status == "fail"]
    new = _new_failures(results, clean_failures)
    errors = [r for r in results if r.status == "error"]
    if new:
        verdict, evidence = "caught", _headline(new[0])
    elif failed:
        verdict, evidence = NOT_CAUGHT_SAME_WAY, _headline(failed[0])
    elif errors:
        verdict, evidence = "error", errors[0].message.splitlines()[0]
    else:
        verdict, evidence = "missed", f"{len(results)} cases passed"
    return PlantOutcome(name, check, description, verdict, time.perf_counter() - started, evidence[:160])


def _new_failures(results: list[CaseResult], clean_failures: set[tuple[str, str]]) -> list[CaseResult]:
    return [r for r in results if r.status == "fail" and failure_signature(r) not in clean_failures]


def _headline(case: CaseResult) -> str:
    """The line of a failure that says what differed: a located difference if there is one."""
    lines = [line.strip() for line in case.message.splitlines() if line.strip()]
    located = [line for line in lines if line.startswith(("[value]", "[structure]", "[vs-unsharded]"))]
    return (located or lines or [case.case_id])[0]


def run_clean(check: str, config: GateConfig, pools: PoolProvider) -> CleanRun:
    results, _ = run_checks([check], config, pools)
    return CleanRun(check, config.seed, results)


def format_table(outcomes: list[PlantOutcome]) -> str:
    rows = [("planted bug", "expected catching check", "result", "time (s)", "evidence")]
    rows += [(o.plant, o.check, o.verdict, f"{o.seconds:.1f}", o.evidence) for o in outcomes]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(widths[i]) if i < 4 else cell for i, cell in enumerate(row)) for row in rows]
    caught = sum(o.verdict == "caught" for o in outcomes)
    lines.append(f"kill rate: {caught}/{len(outcomes)}" + (f" ({100 * caught / len(outcomes):.0f}%)" if outcomes else ""))
    return "\n".join(lines)


def catalog() -> dict[str, plants.Plant]:
    """Every planted bug of every check, found through the check registry."""
    load_plants(list(CHECK_PACKAGES))
    return dict(plants.PLANTS)


def run_selftest_command(names: list[str] | None, list_only: bool, device: str, examples: int, clean_seeds: int) -> int:
    """The command: print the catalog, or run the plants and the clean runs; exit 1 on a miss or false alarm."""
    known = catalog()
    if list_only:
        for name in sorted(known):
            print(f"{name:<32} {known[name].check:<10} {known[name].description}")
        return 0
    names = names or sorted(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise HarnessError(f"unknown planted bug(s) {unknown}; `paritykit selftest --list` shows the catalog")
    outcomes: list[PlantOutcome] = []
    clean_runs: dict[tuple[str, int], CleanRun] = {}
    checks = sorted({known[n].check for n in names})

    def config(seed: int) -> GateConfig:
        return GateConfig(device=device, world_sizes=(2,), hosts=DEFAULT_HOSTS, examples=examples, seed=seed, shrink=False)

    def clean(check: str, seed: int) -> CleanRun:
        if (check, seed) not in clean_runs:
            clean_runs[(check, seed)] = run_clean(check, config(seed), pools)
        return clean_runs[(check, seed)]

    with PoolProvider(device=device) as pools:
        for name in names:
            outcomes.append(run_plant(name, config(0), pools, clean(known[name].check, 0)))
            print(f"paritykit selftest: {name}: {outcomes[-1].verdict}", file=sys.stderr, flush=True)
        for seed in range(clean_seeds):
            for check in checks:
                clean(check, seed)
    print(format_table(outcomes))
    counted = [run for (_check, seed), run in clean_runs.items() if seed < max(clean_seeds, 1)]
    false_alarms = [case for run in counted for case in run.false_alarms]
    print(f"false alarms: {len(false_alarms)} in {sum(r.cases for r in counted)} clean cases "
          f"({len(counted)} clean runs: checks {', '.join(checks)} x {max(clean_seeds, 1)} seeds)")
    for case in false_alarms:
        print(f"  [{case.status}] {case.check} :: {case.case_id}: {case.message.splitlines()[0] if case.message else ''}")
    missed = [o for o in outcomes if o.verdict != "caught"]
    return 1 if missed or false_alarms else 0

