"""A gate run's report and its renderers (terminal, Markdown, JSON, JUnit XML).

Failures come first everywhere a person reads (terminal, report.md); JUnit keeps one testcase per
case; every case carries its short id, the one ``paritykit gate --case`` takes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from paritykit.checks.results import STATUSES, CaseResult
from paritykit.gate import compare as comparing
from paritykit.gate.findings import Finding
from paritykit.gate.findings import group as group_failures

# Bump when a field is renamed or removed, or the document changes shape; old fields stay.
# 2: "findings" (failures grouped by root cause) and each case's "divergence" and "configuration".
JSON_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)

# Statuses that make the gate fail. "error" is the harness's own (exit 2), decided in the CLI.
FAILING_STATUSES = frozenset({"fail", "error"})
# The order people read cases in: what needs action first.
READING_ORDER = ("fail", "error", "known-issue", "skip", "unsupported", "pass")
# Metrics text per passing case in report.md (the JSON has them all).
METRICS_CHARS = 160
# What --report DIR writes (checked writable before any case runs).
REPORT_FILES = ("report.md", "report.json", "junit.xml")


@dataclass
class Report:
    """All cases of a gate run, plus the environment they ran in, notes, and a comparison with an older run."""

    cases: list[CaseResult] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    comparison: comparing.Comparison | None = None
    # Filled by the CLI: short id of a finding's smallest case -> the known issues its configuration
    # matches; finding id -> its standalone script, relative to the report directory.
    known_issue_matches: dict[str, list[str]] = field(default_factory=dict, compare=False)
    scripts: dict[str, str] = field(default_factory=dict, compare=False)

    def extend(self, results: list[CaseResult]) -> None:
        self.cases.extend(results)

    def counts(self, check: str | None = None) -> dict[str, int]:
        counts = {status: 0 for status in STATUSES}
        for case in self.cases:
            if check is None or case.check == check:
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

    def in_reading_order(self) -> list[CaseResult]:
        return sorted(self.cases, key=lambda c: READING_ORDER.index(c.status))

    def findings(self) -> list[Finding]:
        """The failures grouped by root cause (findings.py), with the known issues each one's smallest
        configuration matches and the script written for it (``scripts``: finding id -> path)."""
        found = group_failures([c for c in self.cases if c.status == "fail"])
        for finding in found:
            finding.known_issues = list(self.known_issue_matches.get(finding.smallest.short_id, []))
            finding.script = self.scripts.get(finding.id, "")
        return found


def verdict(counts: dict[str, int]) -> str:
    return "FAIL" if counts["fail"] else "ERROR" if counts["error"] else "ok"


# ---------------------------------------------------------------- terminal


def render_terminal(report: Report) -> str:
    """One line per finding, one per check, then every non-passing case (failures first) with its message and replay."""
    lines = [f"finding {finding.headline()}" for finding in report.findings()]
    for check in report.checks():
        counts = report.counts(check)
        parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        lines.append(f"{check:<10} {verdict(counts):<5} {parts}")
    for case in report.in_reading_order():
        if case.status == "pass":
            continue
        lines.append("")
        lines.append(f"[{case.status}] {case.check} :: {case.case_id}  (case {case.short_id})")
        if case.message:
            lines.extend("    " + line for line in case.message.splitlines())
        if case.replay:
            lines.append(f"    replay: {case.replay}")
    for note in report.notes:
        lines.append(f"note: {note}")
    if report.comparison is not None:
        lines.append("")
        lines.extend(comparing.render_terminal(report.comparison))
    counts = report.counts()
    lines.append("")
    lines.append("total: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) if report.cases else "total: no cases ran")
    return "\n".join(lines)


# ---------------------------------------------------------------- Markdown


def render_markdown(report: Report) -> str:
    findings = report.findings()
    out = ["# paritykit gate report", "", _summary_line(report), ""]
    out += _finding_lines(findings)
    out += _summary_table(report)
    out += _finding_details(findings)
    problems = [c for c in report.in_reading_order() if c.status in FAILING_STATUSES]
    out += [f"## Failures ({len(problems)})", ""] + (_details(problems) if problems else ["none", ""])
    if report.comparison is not None:
        out += comparing.render_markdown(report.comparison)
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    others = [c for c in report.in_reading_order() if c.status not in FAILING_STATUSES and c.status != "pass"]
    if others:
        out += [f"## Known issues, skips and unsupported configurations ({len(others)})", ""] + _details(others)
    out += _passing_tables(report)
    if report.environment:
        out += ["## Environment", "", "| item | value |", "| --- | --- |"]
        out += [f"| {k} | {_md(str(v))} |" for k, v in report.environment.items()] + [""]
    return "\n".join(out)


def _finding_lines(findings: list[Finding]) -> list[str]:
    """One line per finding: what torchrec computes differently, how many cases, the smallest, its replay and script."""
    if not findings:
        return []
    out = [f"## Findings ({len(findings)})", ""]
    for f in findings:
        script = f"; script [{f.script}]({f.script})" if f.script else "; no standalone script"
        known = f"; matches known issue(s) {', '.join(f'`{i}`' for i in f.known_issues)}" if f.known_issues else ""
        out.append(f"- **{_md(f.headline())}**: first at {_md(f.divergence.location())}; replay `{f.smallest.replay}`{script}{known}")
    return out + [""]


def _finding_details(findings: list[Finding]) -> list[str]:
    out = []
    for f in findings:
        out += [f"## Finding {f.id}: {_md(f.what_differs())}", "",
                f"- first divergence (smallest case `{f.smallest.short_id}`): {_md(f.divergence.location())}"]
        out += [f"- {_md(f.divergence.detail[:600])}"] if f.divergence.detail else []
        out += [f"- replay: `{f.smallest.replay}`",
                f"- standalone script (torch and torchrec only): [{f.script}]({f.script})" if f.script else
                "- no standalone script: the smallest case carries no configuration a torchrec-only script can be written from"]
        out += [f"- known issue(s) its configuration matches: {', '.join(f.known_issues)}"] if f.known_issues else []
        out += [f"- cases ({len(f.cases)}): " + ", ".join(f"{c.check} `{c.short_id}`" for c in f.cases), ""]
    return out


def _summary_line(report: Report) -> str:
    counts = report.counts()
    parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no cases ran"
    return f"**{verdict(counts)}** (exit code {report.exit_code()}): {parts}."


def _summary_table(report: Report) -> list[str]:
    out = ["## Summary per check", "", "| check | verdict | " + " | ".join(STATUSES) + " | time (s) |",
           "| --- | --- | " + " | ".join("---" for _ in STATUSES) + " | --- |"]
    for check in report.checks():
        counts = report.counts(check)
        seconds = sum(c.duration_s for c in report.cases if c.check == check)
        out.append(f"| {check} | {verdict(counts)} | " + " | ".join(str(counts[s]) for s in STATUSES) + f" | {seconds:.1f} |")
    return out + [""]


def _details(cases: list[CaseResult]) -> list[str]:
    out = []
    for c in cases:
        out += [f"### [{c.status}] {c.check} :: `{c.short_id}` {_md(c.case_id)}", "", "```", c.message or "(no message)", "```"]
        if c.replay:
            out += ["", f"Replay: `{c.replay}`"]
        out.append("")
    return out


def _passing_tables(report: Report) -> list[str]:
    out = []
    for check in report.checks():
        passed = [c for c in report.cases if c.check == check and c.status == "pass"]
        if not passed:
            continue
        out += [f"## Passing cases: {check} ({len(passed)})", "", "| case | id | duration (s) | metrics |", "| --- | --- | --- | --- |"]
        for c in passed:
            metrics = ", ".join(f"{k}={v}" for k, v in c.metrics.items())
            metrics = metrics if len(metrics) <= METRICS_CHARS else metrics[: METRICS_CHARS - 3] + "..."
            out.append(f"| {_md(c.case_id)} | `{c.short_id}` | {c.duration_s:.3f} | {_md(metrics)} |")
        out.append("")
    return out


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------- JSON


def to_json_dict(report: Report) -> dict[str, Any]:
    """The JSON document: {"schema_version", "environment", "summary", "findings": [...], "cases": [...],
    "notes", "comparison"}."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "environment": report.environment,
        "summary": {"counts": report.counts(), "exit_code": report.exit_code()},
        "findings": [finding.to_json() for finding in report.findings()],
        "cases": [{**dataclasses.asdict(c), "short_id": c.short_id} for c in report.cases],
        "notes": report.notes,
        "comparison": None if report.comparison is None else report.comparison.to_json(),
    }


def render_json(report: Report) -> str:
    return json.dumps(to_json_dict(report), indent=2, default=str) + "\n"


def report_from_json(text: str) -> Report:
    """The cases, environment and notes of a report.json (the comparison section is not read back)."""
    data = json.loads(text)
    if data.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(f"report schema_version {data.get('schema_version')!r}, this paritykit reads {READABLE_SCHEMA_VERSIONS}")
    names = {f.name for f in dataclasses.fields(CaseResult)}
    return Report(
        cases=[CaseResult(**{k: v for k, v in case.items() if k in names}) for case in data["cases"]],
        environment=data.get("environment", {}),
        notes=data.get("notes", []),
    )


# ---------------------------------------------------------------- JUnit


def render_junit(report: Report) -> str:
    """JUnit XML: one testsuite per check, one testcase per case (known-issue and unsupported are skipped)."""
    suites = ET.Element("testsuites", name="paritykit")
    for check in report.checks() or []:
        cases = [c for c in report.cases if c.check == check]
        suite = ET.SubElement(
            suites,
            "testsuite",
            name=check,
            tests=str(len(cases)),
            failures=str(sum(c.status == "fail" for c in cases)),
            errors=str(sum(c.status == "error" for c in cases)),
            skipped=str(sum(c.status in ("skip", "known-issue", "unsupported") for c in cases)),
            time=f"{sum(c.duration_s for c in cases):.3f}",
        )
        for c in cases:
            element = ET.SubElement(suite, "testcase", classname=f"paritykit.{check}", name=c.case_id, time=f"{c.duration_s:.3f}")
            body = c.message + (f"\nreplay: {c.replay}" if c.replay else "")
            if c.status == "fail":
                ET.SubElement(element, "failure", message=_first_line(c.message)).text = body
            elif c.status == "error":
                ET.SubElement(element, "error", message=_first_line(c.message)).text = body
            elif c.status in ("skip", "known-issue", "unsupported"):
                ET.SubElement(element, "skipped", message=f"{c.status}: {_first_line(c.message)}")
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def write_report(report: Report, directory: Path) -> list[Path]:
    """Write report.md, report.json and junit.xml into ``directory`` (the findings' scripts are written
    first, by the CLI, into ``report.scripts``); return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("report.md", render_markdown(report)), ("report.json", render_json(report)), ("junit.xml", render_junit(report))):
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
