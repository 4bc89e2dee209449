"""Running the selected checks over one set of pools, and judging the results against the known issues.

The CLI's gate and the self-test both go through ``run_checks``, so known issues are applied in
exactly one place and a known torchrec failure never counts as a catch or a false alarm.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from paritykit.checks import run_check
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig
from paritykit.dist import PoolProvider
from paritykit.errors import HarnessError, ParityError, RankFailure
from paritykit.gate import known_issues
from paritykit.harness.versions import installed_versions


def run_one(name: str, config: GateConfig, pools: PoolProvider, *, progress: bool = False) -> list[CaseResult]:
    """One check's raw results; an exception escaping the check becomes a single result for it."""
    started = time.perf_counter()
    if progress:
        print(f"paritykit gate: {name} ...", file=sys.stderr, flush=True)
    try:
        results = run_check(name, config, pools)
    except HarnessError as exc:
        results = [CaseResult(name, "<check>", "error", replay=config.replay(name), message=str(exc))]
    except (ParityError, RankFailure) as exc:
        results = [CaseResult(name, "<check>", "fail", replay=config.replay(name), message=str(exc))]
    if progress:
        passed = sum(r.status == "pass" for r in results)
        print(f"paritykit gate: {name} done in {time.perf_counter() - started:.1f}s: {passed}/{len(results)} passed",
              file=sys.stderr, flush=True)
    return results


def run_checks(
    names: list[str],
    config: GateConfig,
    pools: PoolProvider,
    known_issues_file: Path = known_issues.DEFAULT_FILE,
    *,
    progress: bool = False,
) -> tuple[list[CaseResult], list[known_issues.KnownIssue]]:
    """(results with known failures marked, applicable known issues that did not reproduce)."""
    results = [case for name in names for case in run_one(name, config, pools, progress=progress)]
    return known_issues.apply(results, known_issues.load(known_issues_file), installed_versions())
