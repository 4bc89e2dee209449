"""The result model every check produces, and its renderers (terminal, Markdown, JSON, JUnit XML)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

# Bump when a field is renamed or removed; adding a field is backwards compatible.
JSON_SCHEMA_VERSION = 1

STATUSES = ("pass", "fail", "error", "skip", "known-issue", "unsupported")
# Statuses that make the gate fail. "error" is the harness's own (exit 2), decided in the CLI.
FAILING_STATUSES = frozenset({"fail", "error"})


@dataclass
class CaseResult:
    """One case of one check.

    status: pass, fail (parity broken, rank crashed or hung), error (the harness could not
    run it), skip (with a reason in message), known-issue (a listed known failure),
    unsupported (torchrec rejected the configuration; message carries its words).
    """

    check: str
    case_id: str
    status: str
    replay: str = ""
    message: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"CaseResult.status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class Report:
    """All cases of a gate run, plus the environment they ran in."""

    cases: list[CaseResult] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def extend(self, results: list[CaseResult]) -> None:
        self.cases.extend(results)

    def counts(self) -> dict[str, int]:
        counts = {status: 0 for status in STATUSES}
        for case in self.cases:
            counts[case.status] += 1
        return counts

    def checks(self) -> list[str]:
        return list(dict.fromkeys(case.check for case in self.cases))

    def exit_code(self) -> int:
        """0 all passed; 1 any parity failure; 2 the harness could not run something (and nothing failed)."""
        statuses = {case.status for case in self.cases}
        if "fail" in statuses:
            return 1
        if "error" in statuses:
            return 2
        return 0
