"""A gate run's report and its renderers (terminal, Markdown, JSON, JUnit XML)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from paritykit.checks.results import STATUSES, CaseResult

# Bump when a field is renamed or removed; adding a field is backwards compatible.
JSON_SCHEMA_VERSION = 1

# Statuses that make the gate fail. "error" is the harness's own (exit 2), decided in the CLI.
FAILING_STATUSES = frozenset({"fail", "error"})


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


# ---------------------------------------------------------------- renderers


def render_terminal(report: Report) -> str:
    """A short summary: one line per check, then every non-passing case with its message and replay."""
    lines = []
    for check in report.checks():
        cases = [c for c in report.cases if c.check == check]
        counts = {s: sum(1 for c in cases if c.status == s) for s in STATUSES}
        parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        verdict = "FAIL" if counts["fail"] else "ERROR" if counts["error"] else "ok"
        lines.append(f"{check:<10} {verdict:<5} {parts}")
    for case in report.cases:
        if case.status in ("pass",):
            continue
        lines.append("")
        lines.append(f"[{case.status}] {case.check} :: {case.case_id}")
        if case.message:
            lines.extend("    " + line for line in case.message.splitlines())
        if case.replay:
            lines.append(f"    replay: {case.replay}")
    for note in report.notes:
        lines.append(f"note: {note}")
    counts = report.counts()
    lines.append("")
    lines.append("total: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) if report.cases else "total: no cases ran")
    return "\n".join(lines)


def render_markdown(report: Report) -> str:
    out = ["# paritykit gate report", ""]
    if report.environment:
        out += ["## Environment", "", "| item | value |", "| --- | --- |"]
        out += [f"| {k} | {_md(str(v))} |" for k, v in report.environment.items()]
        out.append("")
    out += ["## Summary", "", "| check | pass | fail | error | skip | known-issue | unsupported |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for check in report.checks():
        cases = [c for c in report.cases if c.check == check]
        out.append(f"| {check} | " + " | ".join(str(sum(1 for c in cases if c.status == s)) for s in STATUSES) + " |")
    out.append("")
    out += ["## Cases", "", "| check | case | status | duration (s) | metrics |", "| --- | --- | --- | --- | --- |"]
    for c in report.cases:
        metrics = ", ".join(f"{k}={v}" for k, v in c.metrics.items())
        out.append(f"| {c.check} | {_md(c.case_id)} | {c.status} | {c.duration_s:.3f} | {_md(metrics)} |")
    problems = [c for c in report.cases if c.status not in ("pass",)]
    if problems:
        out += ["", "## Details", ""]
        for c in problems:
            out += [f"### [{c.status}] {c.check} :: {_md(c.case_id)}", "", "```", c.message or "(no message)", "```"]
            if c.replay:
                out += ["", f"Replay: `{c.replay}`"]
            out.append("")
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(out) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_json_dict(report: Report) -> dict[str, Any]:
    """The JSON document: {"schema_version", "environment", "summary", "cases": [...], "notes"}."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "environment": report.environment,
        "summary": {"counts": report.counts(), "exit_code": report.exit_code()},
        "cases": [dataclasses.asdict(c) for c in report.cases],
        "notes": report.notes,
    }


def render_json(report: Report) -> str:
    return json.dumps(to_json_dict(report), indent=2, default=str) + "\n"


def report_from_json(text: str) -> Report:
    data = json.loads(text)
    if data.get("schema_version") != JSON_SCHEMA_VERSION:
        raise ValueError(f"report schema_version {data.get('schema_version')!r}, this paritykit reads {JSON_SCHEMA_VERSION}")
    return Report(
        cases=[CaseResult(**case) for case in data["cases"]],
        environment=data.get("environment", {}),
        notes=data.get("notes", []),
    )


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
    """Write report.md, report.json and junit.xml into ``directory``; return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("report.md", render_markdown(report)), ("report.json", render_json(report)), ("junit.xml", render_junit(report))):
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
