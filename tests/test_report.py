"""Report renderers: terminal, Markdown, JSON (versioned schema, round-trips) and JUnit XML (parsed back)."""

import json
from xml.etree import ElementTree as ET

import pytest

from paritykit.checks.results import short_case_id
from paritykit.gate.report import (
    JSON_SCHEMA_VERSION,
    CaseResult,
    Report,
    render_json,
    render_junit,
    render_markdown,
    render_terminal,
    report_from_json,
    write_report,
)


def sample_report():
    return Report(
        cases=[
            CaseResult("td-kjt", "ebc-sum", "pass", replay="paritykit gate --check td-kjt", metrics={"max_abs_error": 0.0}, duration_s=0.25),
            CaseResult("td-kjt", "ebc|mean", "fail", replay="replay-1", message="1 difference\n  [value] kt['f1'][0, 1]: 1.0 vs 2.0"),
            CaseResult("sync", "ebc-forward", "error", message="no GPU"),
            CaseResult("sync", "kjt-permute", "skip", message="CUDA-only"),
            CaseResult("cw-stitch", "ec-cw", "unsupported", message="Mixed dimension tables only supported for pooling tables"),
            CaseResult("pipeline", "fp", "known-issue", message="known issue: feature processors"),
        ],
        environment={"torch": "2.13.0"},
        notes=["a note"],
    )


def test_case_status_is_validated():
    with pytest.raises(ValueError, match="status must be one of"):
        CaseResult("sync", "x", "passed")


def test_exit_code_failure_beats_error_beats_pass():
    report = sample_report()
    assert report.exit_code() == 1
    report.cases = [c for c in report.cases if c.status != "fail"]
    assert report.exit_code() == 2
    report.cases = [c for c in report.cases if c.status != "error"]
    assert report.exit_code() == 0


def test_terminal_lists_every_non_passing_case_with_replay():
    text = render_terminal(sample_report())
    assert "td-kjt     FAIL  1 pass, 1 fail" in text
    assert "[fail] td-kjt :: ebc|mean" in text
    assert "replay: replay-1" in text
    assert "[unsupported] cw-stitch :: ec-cw" in text
    assert "total: 1 pass, 1 fail, 1 error, 1 skip, 1 known-issue, 1 unsupported" in text


def test_markdown_escapes_pipes_and_has_details():
    text = render_markdown(sample_report())
    assert "ebc\\|mean" in text
    assert "Replay: `replay-1`" in text


def test_markdown_has_a_summary_row_per_check_and_lists_failures_before_anything_else():
    report = sample_report()
    text = render_markdown(report)
    assert "| td-kjt | FAIL | 1 | 1 | 0 | 0 | 0 | 0 | 0.2 |" in text
    assert "| sync | ERROR | 0 | 0 | 1 | 1 | 0 | 0 | 0.0 |" in text
    assert text.startswith("# paritykit gate report\n\n**FAIL** (exit code 1): 1 pass, 1 fail, 1 error")
    failing = text.index("### [fail] td-kjt :: `" + report.cases[1].short_id)
    error = text.index("### [error] sync :: ")
    known = text.index("### [known-issue] pipeline :: ")
    passing = text.index("| ebc-sum | `" + report.cases[0].short_id)
    assert text.index("## Failures (2)") < failing < error < known < passing


def test_terminal_lists_failures_first_with_the_short_id_that_replays_them():
    report = sample_report()
    text = render_terminal(report)
    assert text.index("[fail] td-kjt") < text.index("[error] sync") < text.index("[known-issue] pipeline") < text.index("[skip] sync")
    assert f"[fail] td-kjt :: ebc|mean  (case {report.cases[1].short_id})" in text


def test_json_is_versioned_and_round_trips():
    report = sample_report()
    data = json.loads(render_json(report))
    assert data["schema_version"] == JSON_SCHEMA_VERSION
    assert [c["short_id"] for c in data["cases"]] == [short_case_id(c.check, c.case_id) for c in report.cases]
    assert data["summary"]["exit_code"] == 1
    assert data["summary"]["counts"]["fail"] == 1
    assert report_from_json(render_json(report)) == report


def test_json_from_another_schema_version_is_refused():
    data = json.loads(render_json(sample_report()))
    data["schema_version"] = JSON_SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match="schema_version"):
        report_from_json(json.dumps(data))


def test_junit_parses_back_with_counts_per_suite():
    root = ET.fromstring(render_junit(sample_report()))
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {"td-kjt", "sync", "cw-stitch", "pipeline"}
    assert (suites["td-kjt"].get("tests"), suites["td-kjt"].get("failures")) == ("2", "1")
    assert suites["sync"].get("errors") == "1" and suites["sync"].get("skipped") == "1"
    failure = suites["td-kjt"].find("testcase[@name='ebc|mean']/failure")
    assert failure.get("message") == "1 difference"
    assert "replay: replay-1" in failure.text
    assert suites["pipeline"].find("testcase/skipped").get("message").startswith("known-issue")
    # One testcase per case, whatever its status.
    assert len(root.findall("testsuite/testcase")) == len(sample_report().cases)


def test_write_report_writes_three_files(tmp_path):
    paths = write_report(sample_report(), tmp_path / "out")
    assert sorted(p.name for p in paths) == ["junit.xml", "report.json", "report.md"]
    assert all(p.stat().st_size > 0 for p in paths)
