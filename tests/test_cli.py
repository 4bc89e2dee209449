"""The gate's command-line contract: exit codes 0/1/2, report files, known issues, --strict."""

import json
import subprocess
import sys
from importlib.metadata import version

from pathlib import Path

import pytest
import torch

from paritykit.checks import CHECK_PACKAGES
from paritykit.gate import cli

from stand_in_check import OUTCOME_ENV


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setitem(CHECK_PACKAGES, "stand-in", "stand_in_check")

    def gate(outcome, *extra):
        monkeypatch.setenv(OUTCOME_ENV, outcome)
        return cli.main(["gate", "--check", "stand-in", "--known-issues", "/nonexistent", *extra])

    return gate


def test_gate_exit_codes(stand_in):
    assert stand_in("pass") == 0
    assert stand_in("fail") == 1
    assert stand_in("harness-error") == 2


def test_gate_writes_reports(stand_in, tmp_path, capsys):
    assert stand_in("fail", "--report", str(tmp_path)) == 1
    data = json.loads((tmp_path / "report.json").read_text())
    assert [c["status"] for c in data["cases"]] == ["pass", "fail"]
    assert "replay: paritykit gate --check stand-in" in capsys.readouterr().out
    assert (tmp_path / "junit.xml").exists() and (tmp_path / "report.md").exists()


def test_known_issue_does_not_fail_the_gate_and_stale_one_fails_under_strict(stand_in, tmp_path, monkeypatch):
    listed = tmp_path / "known.toml"
    listed.write_text('[[issue]]\ncheck = "stand-in"\ncase = "case-*"\nreason = "listed"\nversions = { torch = "*" }\n')
    monkeypatch.setenv(OUTCOME_ENV, "fail")
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed)]) == 0
    monkeypatch.setenv(OUTCOME_ENV, "pass")
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed)]) == 0
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed), "--strict"]) == 1


def test_known_issue_listed_for_other_versions_is_carried_over_and_fails_only_under_strict(stand_in, tmp_path, monkeypatch, capsys):
    listed = tmp_path / "known.toml"
    listed.write_text('[[issue]]\ncheck = "stand-in"\ncase = "case-*"\nreason = "old"\nversions = { torch = "1.*" }\n')
    monkeypatch.setenv(OUTCOME_ENV, "fail")
    report = tmp_path / "report"
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed), "--report", str(report)]) == 0
    case = json.loads((report / "report.json").read_text())["cases"][1]
    torch_version = version("torch")  # what the package metadata says, as the gate reads it
    assert case["status"] == "known-issue"
    assert case["message"].startswith(f"known issue, carried over: known in torch 1.*, still reproduces in torch {torch_version}: old.")
    out = capsys.readouterr().out
    assert f"note: known issue carried over: stand-in 'case-*' is known in torch 1.* and still reproduces in torch {torch_version}" in out
    assert "extend its versions in" in out
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed), "--strict"]) == 1


def test_known_issue_fixed_in_an_earlier_version_that_fails_again_is_a_regression(stand_in, tmp_path, monkeypatch, capsys):
    listed = tmp_path / "known.toml"
    listed.write_text('[[issue]]\ncheck = "stand-in"\ncase = "case-*"\nreason = "old"\n'
                      'versions = { torch = "1.*" }\nfixed_in = { torch = "2.0" }\n')
    monkeypatch.setenv(OUTCOME_ENV, "fail")
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed)]) == 1
    assert "matches known issue 'case-*', fixed in torch 2.0: a regression of a fixed issue" in capsys.readouterr().out
    # A fixed issue that does not reproduce is what the file says: nothing to report, even under --strict.
    monkeypatch.setenv(OUTCOME_ENV, "pass")
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed), "--strict"]) == 0


def test_strict_reports_an_entry_for_any_version_that_no_longer_reproduces(stand_in, tmp_path, monkeypatch, capsys):
    listed = tmp_path / "known.toml"
    listed.write_text('[[issue]]\ncheck = "stand-in"\ncase = "case-*"\nreason = "old"\nversions = { torch = "1.*" }\n')
    monkeypatch.setenv(OUTCOME_ENV, "pass")
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed)]) == 0
    assert "note: known issue no longer reproduces: stand-in 'case-*' (listed for torch 1.*) did not fail" in capsys.readouterr().out
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", str(listed), "--strict"]) == 1


def test_unimplemented_check_exits_2_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(CHECK_PACKAGES, "future", "paritykit.checks.not_written_yet")
    assert cli.main(["gate", "--check", "future"]) == 2
    assert "check 'future' is not implemented" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-GPU path; this machine has CUDA")
def test_cuda_without_gpu_exits_2(capsys):
    assert cli.main(["gate", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as info:
        cli.main(["gate", "--world-size", "0"])
    assert info.value.code == 2


def test_info_prints_versions_through_the_console_script():
    out = subprocess.run([sys.executable, "-m", "paritykit", "info"], capture_output=True, text=True, check=True).stdout
    assert f"torch            {version('torch')}" in out
    assert "torchrec" in out and "backends" in out


def test_known_issue_marking_is_idempotent_and_still_counts_as_reproduced():
    from paritykit.checks.known_issues import KnownIssue, apply
    from paritykit.gate.report import CaseResult

    issue = KnownIssue(check="c", case="broken-*", reason="upstream bug")
    cases = [CaseResult("c", "broken-1", "fail", message="boom"), CaseResult("c", "fine", "pass")]
    once = apply(cases, [issue], {})
    twice = apply(once.cases, [issue], {})
    assert [c.status for c in twice.cases] == ["known-issue", "pass"] and twice.cases == once.cases
    assert once.stale == twice.stale == [] and once.carried == twice.carried == []
    assert once.cases[0].message.startswith("known issue: upstream bug\nboom")


def test_a_known_issue_with_a_symptom_excuses_only_the_failure_that_shows_it():
    from paritykit.checks.known_issues import KnownIssue, apply
    from paritykit.gate.report import CaseResult

    issue = KnownIssue(check="c", case="broken-*", reason="upstream bug", id="bug", symptom=r"columns in host order")
    cases = [CaseResult("c", "broken-1", "fail", message="outputs differ: they are its columns in host order"),
             CaseResult("c", "broken-2", "fail", message="rank 0 raised IndexError"),
             CaseResult("c", "broken-3", "skip", message="not under torchrun")]
    judged = apply(cases, [issue], {})
    assert [c.status for c in judged.cases] == ["known-issue", "fail", "skip"]
    assert judged.cases[1].message.startswith("fails otherwise than known issue bug: its failure shows /columns in host order/")
    assert judged.stale == []  # reproduced by the first case; a skip never makes an entry stale either


def test_unknown_benchmark_exits_2_listing_the_available_ones(capsys):
    assert cli.main(["bench", "no-such-bench"]) == 2
    bench = Path(__file__).resolve().parent.parent / "bench"
    available = sorted(path.stem.removeprefix("bench_") for path in bench.glob("bench_*.py"))
    assert len(available) >= 3 and f"available: {', '.join(available)}\n" in capsys.readouterr().err
