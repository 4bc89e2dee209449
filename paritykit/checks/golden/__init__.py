"""fixtures (golden numbers): recorded cases recomputed with the installed stack.

recipes.py  how each fixture's inputs and reference numbers are made
store.py    record and verify (manifest with versions and sha256 per file)
plants.py   a planted bug that moves the numbers on both sides of every other comparison
"""

from __future__ import annotations

from paritykit.checks.golden import store
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import CheckEntry, GateConfig

NAME = store.CHECK


def run_fixtures(config: GateConfig, pools: object) -> list[CaseResult]:
    if not (store.DEFAULT_DIR / store.MANIFEST).exists():
        return [CaseResult(NAME, "<fixtures>", "skip", message=f"no golden fixtures at {store.DEFAULT_DIR} (an installed wheel ships none)")]
    return store.verify(store.DEFAULT_DIR)


CHECK = CheckEntry(NAME, plants="paritykit.checks.golden.plants", run=run_fixtures)

__all__ = ["CHECK"]
