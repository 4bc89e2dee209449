"""Running the selected checks over one set of pools, and judging the results against the known issues.

The CLI's gate and the self-test both go through ``run_checks``, so known issues are applied in
exactly one place and a known torchrec failure never counts as a catch or a false alarm.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from paritykit.checks import known_issues, run_check
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import NOT_RUN_ANSWERED, GateConfig, result_from_exception, stopped_early
from paritykit.dist import PoolProvider
from paritykit.errors import HarnessError
from paritykit.harness.versions import installed_versions

# Results about a check as a whole, kept whatever --case selects.
WHOLE_CHECK_IDS = ("<check>", "<property>", "<nothing compared>")


def run_one(name: str, config: GateConfig, pools: Any, *, progress: bool = False) -> list[CaseResult]:
    """One check's results (the cases ``config.case`` selects); an exception escaping the check
    becomes a single result for it, mapped by the same rule as a case's."""
    started = time.perf_counter()
    if progress:
        print(f"paritykit gate: {name} ...", file=sys.stderr, flush=True)
    try:
        results = run_check(name, config, pools)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every outcome becomes a result
        results = [result_from_exception(name, "<check>", config.replay(name), exc, started)]
    results = [r for r in results if r.case_id in WHOLE_CHECK_IDS or config.selects(r.check, r.case_id)]
    results = [r for r in results if r.message != NOT_RUN_ANSWERED]
    results += nothing_compared(name, results, config)
    if progress:
        passed = sum(r.status == "pass" for r in results)
        print(f"paritykit gate: {name} done in {time.perf_counter() - started:.1f}s: {passed}/{len(results)} passed",
              file=sys.stderr, flush=True)
    return results


def nothing_compared(name: str, results: list[CaseResult], config: GateConfig) -> list[CaseResult]:
    """An error when every case of the check that would have passed compared nothing."""
    empty = [r for r in results if r.compared_nothing]
    if not empty or any(r.status in ("pass", "fail", "error") for r in results):
        return []
    reasons = sorted({r.message for r in empty})
    message = (f"check {name} compared nothing: all {len(empty)} of its cases that ran were empty "
               f"({'; '.join(reasons[:3])})")
    return [CaseResult(name, "<nothing compared>", "error", replay=config.replay(name), message=message)]


class LazyPools:
    """A PoolProvider whose pools start on first use, so a ``--case`` run starts only the pool its case needs."""

    def __init__(self, pools: PoolProvider) -> None:
        self._pools = pools

    def get(self, world_size: int, backend: str | None = None, *, ranks_per_host: int | None = None) -> "_LazyPool":
        return _LazyPool(self._pools, world_size, backend, ranks_per_host)


class _LazyPool:
    def __init__(self, pools: PoolProvider, world_size: int, backend: str | None, ranks_per_host: int | None = None) -> None:
        self._pools, self.world_size, self._backend, self._ranks_per_host = pools, world_size, backend, ranks_per_host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pools.get(self.world_size, self._backend, ranks_per_host=self._ranks_per_host), name)


def run_checks(
    names: list[str],
    config: GateConfig,
    pools: PoolProvider,
    known_issues_file: Path = known_issues.DEFAULT_FILE,
    *,
    progress: bool = False,
) -> tuple[list[CaseResult], known_issues.Judgement]:
    """(results with known failures marked, what the known-issues file should say instead).

    The draws follow ``known_issues_file`` too; with ``config.case`` only the selected case runs,
    and no case matching it is a HarnessError.
    """
    issues = known_issues.load(known_issues_file)
    runnable = LazyPools(pools) if config.case is not None else pools
    with known_issues.use_file(known_issues_file):
        results = [case for name in names for case in run_one(name, config, runnable, progress=progress)]
    if config.case is not None and not results:
        raise HarnessError(
            f"no case of {', '.join(names)} has the id {config.case!r} with these arguments (seed, world sizes, "
            "examples, device): a replay must use the arguments of the run that reported the case"
        )
    complete = config.case is None and not stopped_early()
    return_value = known_issues.apply(results, issues, installed_versions(), complete=complete)
    return return_value.cases, return_value
