"""fixtures (golden numbers): recorded cases recomputed with the installed stack.

recipes.py  how each fixture's inputs and reference numbers are made
store.py    record and verify (per-stack goldens, manifest with versions and sha256 per file)
plants.py   a planted bug that moves the numbers on both sides of every other comparison
fixtures/   the goldens shipped with the package
"""

from __future__ import annotations

from dataclasses import replace

from paritykit.checks.golden import store
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import CheckEntry, GateConfig

NAME = store.CHECK


def run_fixtures(config: GateConfig, pools: object) -> list[CaseResult]:
    """Every fixture against the goldens; no fixtures at all is a loud skip, and an error under --strict."""
    directory = config.fixtures_dir or store.DEFAULT_DIR
    if not (directory / store.MANIFEST).exists():
        status = "error" if config.strict else "skip"
        return [CaseResult(NAME, "<fixtures>", status, replay=config.replay(NAME), message=store.missing_fixtures_message(directory))]
    return [replace(result, replay=config.replay(NAME, result.case_id)) for result in store.verify(directory)
            if config.selects(NAME, result.case_id)]


CHECK = CheckEntry(NAME, plants="paritykit.checks.golden.plants", run=run_fixtures)

__all__ = ["CHECK"]
