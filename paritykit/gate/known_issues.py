"""Known failures: listed, versioned, and re-checked on every gate run.

A known issue names a check, a case pattern (fnmatch over the case id), the package versions it
applies to, a reason and an upstream reference. A failing case that matches an applicable entry is
reported as ``known-issue`` and does not fail the gate. An applicable entry that matched no failing
case "no longer reproduces": reported as a note, and a failure of the gate under ``--strict``.
A failure that matches no entry always fails.

The file is TOML::

    [[issue]]
    check = "pipeline"
    case = "*feature_processor*"
    versions = { torchrec = "1.8.*" }
    reason = "TrainPipelineFusedSparseDist looks up embeddings before ..."
    reference = "https://github.com/pytorch/torchrec/pull/2916"
"""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from paritykit.checks.results import CaseResult
from paritykit.errors import HarnessError
from paritykit.harness.versions import installed_versions

DEFAULT_FILE = Path(__file__).with_name("known_issues.toml")


@dataclass(frozen=True)
class KnownIssue:
    check: str
    case: str
    reason: str
    reference: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def applies_to(self, installed: dict[str, str]) -> bool:
        """True when every named package's installed version matches its pattern."""
        return all(fnmatch.fnmatch(installed.get(package, "<not installed>"), pattern) for package, pattern in self.versions.items())

    def matches(self, case: CaseResult) -> bool:
        return case.check == self.check and fnmatch.fnmatch(case.case_id, self.case)


def load(path: Path = DEFAULT_FILE) -> list[KnownIssue]:
    if not path.exists():
        return []
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise HarnessError(f"known-issues file {path} is not valid TOML: {exc}") from exc
    issues = []
    for index, entry in enumerate(data.get("issue", [])):
        missing = [k for k in ("check", "case", "reason") if k not in entry]
        if missing:
            raise HarnessError(f"known-issues file {path}: entry {index} lacks {missing}")
        issues.append(KnownIssue(**entry))
    return issues


def apply(cases: list[CaseResult], issues: list[KnownIssue], installed: dict[str, str]) -> tuple[list[CaseResult], list[KnownIssue]]:
    """Mark matching failures as known issues; return (cases, applicable issues that did not reproduce)."""
    applicable = [issue for issue in issues if issue.applies_to(installed)]
    reproduced: set[int] = set()
    out = []
    for case in cases:
        # A case marked already (apply is idempotent) still counts as a reproduction.
        reproducing = case.status in ("fail", "known-issue")
        hit = next((i for i, issue in enumerate(applicable) if reproducing and issue.matches(case)), None)
        if hit is None:
            out.append(case)
            continue
        reproduced.add(hit)
        if case.status == "known-issue":
            out.append(case)
            continue
        issue = applicable[hit]
        note = f"known issue: {issue.reason}" + (f" ({issue.reference})" if issue.reference else "")
        out.append(replace(case, status="known-issue", message=f"{note}\n{case.message}"))
    ran_checks = {case.check for case in cases}
    stale = [issue for i, issue in enumerate(applicable) if i not in reproduced and issue.check in ran_checks]
    return out, stale
