"""The golden-fixture check: the gate re-computes every recorded fixture with the installed stack."""

from __future__ import annotations

from paritykit import fixtures
from paritykit.checks.base import GateConfig, PoolProvider
from paritykit.report import CaseResult

NAME = "fixtures"


def run(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    if not (fixtures.DEFAULT_DIR / fixtures.MANIFEST).exists():
        return [CaseResult(NAME, "<fixtures>", "skip", message=f"no golden fixtures at {fixtures.DEFAULT_DIR} (an installed wheel ships none)")]
    return fixtures.verify(fixtures.DEFAULT_DIR)
