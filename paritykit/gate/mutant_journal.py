"""A mutation run's journal: every outcome appended as it finishes (``journal.jsonl`` in the report
directory), so that a run of hours that was interrupted resumes where it stopped (``--resume``).

The first line says which run the journal belongs to (the coverage run's cases, the seed, the cases
per mutant); resuming another run's journal is a HarnessError, not a mix.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from paritykit.errors import HarnessError
from paritykit.gate.mutant_run import MutantOutcome
from paritykit.gate.mutants import Mutant

JOURNAL_FILE = "journal.jsonl"


# How the replayed cases are chosen (mutant_run.choose_cases): a journal of another choice is not resumed.
CASE_CHOICE = "readers-and-different-paths-then-broadest-then-fastest-per-check-every-check-once; survivors: a second round of unrun case families"


def run_identity(coverage_dir: Path, seed: int, max_cases: int) -> dict[str, Any]:
    """What decides a mutant's outcome: the covering cases and how many of them run. Not the sample's
    size: a sample runs in the order drawn, so the smaller sample of a seed is the start of the
    larger one, and ``--sample N --resume`` reports the part of a longer run that finished."""
    cases = (Path(coverage_dir) / "cases.json").read_bytes()
    return {"cases_sha256": hashlib.sha256(cases).hexdigest(), "seed": seed, "max_cases": max_cases, "case_choice": CASE_CHOICE}


def outcome_from_json(data: dict[str, Any]) -> MutantOutcome:
    mutant = Mutant(data["file"], data["line"], data["operator"], data["occurrence"])
    return MutantOutcome(mutant, data["before"], data["after"], data["status"], list(data["cases"]),
                         float(data["duration_s"]), data["detail"])


class Journal:
    def __init__(self, out_dir: Path, identity: dict[str, Any], resume: bool) -> None:
        self.path = Path(out_dir) / JOURNAL_FILE
        self._lock = threading.Lock()
        self._done: dict[str, MutantOutcome] = {}
        if resume and self.path.exists():
            lines = self.path.read_text().splitlines()
            if not lines or json.loads(lines[0]) != identity:
                raise HarnessError(f"{self.path} belongs to another mutation run (coverage data, seed or "
                                   "--max-cases differ): resume it with the same arguments, or run without --resume")
            for line in lines[1:]:
                outcome = outcome_from_json(json.loads(line))
                self._done[outcome.mutant.key] = outcome
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(identity) + "\n")

    def done(self, mutant: Mutant) -> MutantOutcome | None:
        return self._done.get(mutant.key)

    def record(self, outcome: MutantOutcome) -> None:
        with self._lock, self.path.open("a") as journal:
            journal.write(json.dumps(outcome.to_json()) + "\n")
