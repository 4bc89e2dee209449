"""The parity checks, one module each. The gate, the assertions and the tests share them.

A check module exposes ``NAME`` (the CLI name) and ``run(config, pools) -> list[CaseResult]``.
Modules are imported lazily so that ``paritykit info`` and the pytest plugin stay cheap.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from paritykit.errors import HarnessError

# CLI name -> module path. Order is the order the gate runs them in.
CHECK_MODULES: dict[str, str] = {
    "td-kjt": "paritykit.checks.td_kjt",
    "cw-stitch": "paritykit.checks.cw_stitch",
    "pipeline": "paritykit.checks.pipeline",
    "sync": "paritykit.checks.sync",
    "fixtures": "paritykit.checks.fixtures",
}


def load_check(name: str) -> ModuleType:
    """Import one check module, or raise HarnessError naming what is missing."""
    if name not in CHECK_MODULES:
        raise HarnessError(f"unknown check {name!r}; known checks: {', '.join(CHECK_MODULES)}")
    try:
        return importlib.import_module(CHECK_MODULES[name])
    except ModuleNotFoundError as exc:
        if exc.name == CHECK_MODULES[name]:
            raise HarnessError(f"check {name!r} is not implemented in this version of paritykit") from exc
        raise


def available_checks() -> list[str]:
    """The check names whose modules exist in this installation."""
    found = []
    for name, module in CHECK_MODULES.items():
        if importlib.util.find_spec(module) is not None:
            found.append(name)
    return found


def run_check(name: str, config, pools, known_issues_file=None) -> list:
    """Run one check and mark failures listed in the known-issues file (default: the shipped one).

    Everything that judges results (the gate, the self-test, tests of a check's run) goes through
    here, so a known torchrec failure can never pass for a caught planted bug or a false alarm.
    """
    from paritykit import known_issues

    results = load_check(name).run(config, pools)
    issues = known_issues.load(known_issues_file or known_issues.DEFAULT_FILE)
    marked, _ = known_issues.apply(results, issues, known_issues.installed_versions())
    return marked
