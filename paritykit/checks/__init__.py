"""The parity checks, one folder each, behind one ``Check`` protocol; the gate, the self-test, the
assertions and the tests all reach a check through this registry.

Each check package (``paritykit/checks/<name>/``) holds everything the check knows: its gate entry
(``CHECK``, an object satisfying ``Check``), its public assertion, its cases and strategies, and
its planted bugs (``plants.py``). Packages are imported lazily so that ``paritykit info`` and the
pytest plugin stay cheap. ``known_issues`` (with ``known_issues.toml``) lives here, below the gate,
because the checks' random draws follow the same entries that the gate judges failures by.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from paritykit.errors import HarnessError

if TYPE_CHECKING:
    from paritykit.checks.results import CaseResult
    from paritykit.checks.runner import GateConfig
    from paritykit.dist import PoolProvider


@runtime_checkable
class Check(Protocol):
    """What the gate runs. ``name`` is the CLI name; ``plants`` the module registering its planted bugs;
    ``oracle`` what its cases compare torchrec against when that is independent of torchrec (else None)."""

    name: str
    plants: str
    oracle: "str | None"

    def run(self, config: "GateConfig", pools: "PoolProvider") -> "list[CaseResult]":
        """Every case of the check under ``config``: one CaseResult each (never raises for a case)."""
        ...


# CLI name -> package. Order is the order the gate runs them in.
CHECK_PACKAGES: dict[str, str] = {
    "td-kjt": "paritykit.checks.td_kjt",
    "sharding": "paritykit.checks.sharding",
    "pipeline": "paritykit.checks.pipeline",
    "checkpoint": "paritykit.checks.checkpoint",
    "sync": "paritykit.checks.sync",
    "sparse-ops": "paritykit.checks.sparse_ops",
    "optim": "paritykit.checks.optim",
    "planner": "paritykit.checks.planner",
    "modules": "paritykit.checks.modules",
    "inference": "paritykit.checks.inference",
    "metrics": "paritykit.checks.metrics",
    "fixtures": "paritykit.checks.golden",
}


# Former names that keep working on the command line.
ALIASES: dict[str, str] = {"cw-stitch": "sharding"}


def load_check(name: str) -> Check:
    """The check called ``name`` (or a former name of it), or HarnessError naming what is missing."""
    name = ALIASES.get(name, name)
    if name not in CHECK_PACKAGES:
        raise HarnessError(f"unknown check {name!r}; known checks: {', '.join(CHECK_PACKAGES)}")
    try:
        module = importlib.import_module(CHECK_PACKAGES[name])
    except ModuleNotFoundError as exc:
        if exc.name == CHECK_PACKAGES[name]:
            raise HarnessError(f"check {name!r} is not implemented in this version of paritykit") from exc
        raise
    check = getattr(module, "CHECK", None)
    if not isinstance(check, Check) or check.name != name:
        raise HarnessError(f"{CHECK_PACKAGES[name]} does not define CHECK for {name!r} (a paritykit.checks.Check)")
    return check


def available_checks() -> list[str]:
    """The check names whose packages exist in this installation."""
    return [name for name, package in CHECK_PACKAGES.items() if importlib.util.find_spec(package) is not None]


def load_plants(names: list[str] | None = None) -> None:
    """Import the planted bugs of the named checks (default: all), which registers them."""
    for name in names or list(CHECK_PACKAGES):
        importlib.import_module(load_check(name).plants)


def run_check(name: str, config: "GateConfig", pools: "PoolProvider") -> "list[CaseResult]":
    """Run one check; its raw results (known issues are judged once, by the gate)."""
    return load_check(name).run(config, pools)
