"""The gate as a release gatekeeper runs it: replays that re-run one case, the same cases for the
same seed, harness defects as exit 2, empty checks as errors, comparisons with an older report,
one progress stream under torchrun, nothing left in the current directory."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import stand_in_check
from paritykit.checks import CHECK_PACKAGES
from paritykit.checks.results import short_case_id
from paritykit.checks.runner import GateConfig
from paritykit.gate import cli
from paritykit.gate.gating import run_checks
from paritykit.gate.selftest import NOT_CAUGHT_SAME_WAY, run_clean, run_plant
from stand_in_check import FAIL_ABOVE_ENV, METRIC_ENV, OUTCOME_ENV

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def gate(monkeypatch, tmp_path):
    """Run `paritykit gate --check stand-in ...`; returns (exit code, report.json as a dict)."""
    monkeypatch.setitem(CHECK_PACKAGES, "stand-in", "stand_in_check")
    stand_in_check.RAN.clear()

    def run(*extra, outcome="pass", report="report"):
        monkeypatch.setenv(OUTCOME_ENV, outcome)
        directory = tmp_path / report
        code = cli.main(["gate", "--check", "stand-in", "--known-issues", "/nonexistent", "--report", str(directory), *extra])
        return code, json.loads((directory / "report.json").read_text())

    return run


def _replay_args(replay: str) -> list[str]:
    words = shlex.split(replay, comments=True)
    assert words[:2] == ["paritykit", "gate"]
    return words[1:]


def test_the_same_seed_and_arguments_draw_the_same_case_ids(gate):
    _, first = gate("--examples", "20", "--seed", "4", outcome="property")
    _, second = gate("--examples", "20", "--seed", "4", outcome="property", report="again")
    ids = [c["case_id"] for c in first["cases"]]
    assert len(ids) >= 10 and ids == [c["case_id"] for c in second["cases"]]
    _, other_seed = gate("--examples", "20", "--seed", "5", outcome="property", report="other")
    assert ids != [c["case_id"] for c in other_seed["cases"]]


def test_case_reruns_exactly_one_case_of_a_property(gate):
    _, full = gate("--examples", "20", "--seed", "4", outcome="property")
    chosen = full["cases"][7]
    stand_in_check.RAN.clear()
    code, alone = gate("--examples", "20", "--seed", "4", "--case", chosen["short_id"], outcome="property", report="alone")
    assert code == 0
    assert [c["case_id"] for c in alone["cases"]] == [chosen["case_id"]] and stand_in_check.RAN == [chosen["case_id"]]


def test_a_failing_cases_replay_command_reruns_it_alone_and_reproduces_it(gate, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(FAIL_ABOVE_ENV, "5000")
    code, full = gate("--examples", "30", "--seed", "2", outcome="property")
    (failure,) = [c for c in full["cases"] if c["status"] == "fail"]
    assert code == 1 and int(failure["case_id"]) > 5000
    stand_in_check.RAN.clear()
    args = _replay_args(failure["replay"])
    assert args[0] == "gate" and args[args.index("--case") + 1] == failure["short_id"] == short_case_id("stand-in", failure["case_id"])
    assert cli.main([*args, "--known-issues", "/nonexistent", "--report", str(tmp_path / "replayed")]) == 1
    replayed = json.loads((tmp_path / "replayed" / "report.json").read_text())["cases"]
    assert [(c["case_id"], c["status"]) for c in replayed] == [(failure["case_id"], "fail")]
    assert stand_in_check.RAN == [failure["case_id"]]


def test_a_case_id_that_matches_nothing_is_a_harness_error(monkeypatch, capsys):
    monkeypatch.setitem(CHECK_PACKAGES, "stand-in", "stand_in_check")
    monkeypatch.setenv(OUTCOME_ENV, "property")
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", "/nonexistent", "--case", "0000000000"]) == 2
    assert "no case of stand-in has the id '0000000000'" in capsys.readouterr().err


def test_an_exception_escaping_a_check_from_paritykits_code_exits_2_and_from_torchrec_exits_1(gate):
    code, report = gate(outcome="paritykit-bug")
    assert code == 2 and report["cases"][0]["status"] == "error"
    assert "harness error: an exception raised in paritykit's own code" in report["cases"][0]["message"]
    code, report = gate(outcome="torchrec-bug", report="torchrec")
    assert code == 1 and report["cases"][0]["status"] == "fail"


def test_a_check_whose_cases_all_compared_nothing_is_an_error(gate):
    code, report = gate(outcome="empty")
    statuses = {c["case_id"]: (c["status"], c["message"]) for c in report["cases"]}
    assert statuses["case-a"] == ("skip", "nothing compared: nothing drawn")
    assert statuses["case-b"] == ("skip", "nothing compared: zero batches")
    assert statuses["<nothing compared>"][0] == "error" and code == 2
    assert statuses["<nothing compared>"][1].startswith("check stand-in compared nothing: all 2 of its cases that ran were empty")


def test_compare_to_lists_new_failures_fixed_known_issues_and_moved_metrics(gate, monkeypatch, tmp_path):
    known = tmp_path / "known.toml"
    known.write_text('[[issue]]\ncheck = "stand-in"\ncase = "case-b"\nreason = "listed"\nversions = { torch = "*" }\n')
    monkeypatch.setenv(METRIC_ENV, "0.25")
    code, old = gate("--known-issues", str(known), outcome="fail", report="old")
    assert code == 0 and [c["status"] for c in old["cases"]] == ["pass", "known-issue"]
    monkeypatch.setenv(METRIC_ENV, "0.5")
    code, new = gate("--compare-to", str(tmp_path / "old" / "report.json"), outcome="pass", report="new")
    comparison = new["comparison"]
    assert comparison["fixed_known_issues"] == [{"check": "stand-in", "case_id": "case-b"}]
    assert comparison["moved_metrics"] == [{"check": "stand-in", "case_id": "case-a", "metric": "max_abs_error", "old": 0.25, "new": 0.5}]
    assert comparison["new_failures"] == []
    code, newer = gate("--compare-to", str(tmp_path / "new" / "report.json"), outcome="fail", report="newer")
    assert newer["comparison"]["new_failures"] == [{"check": "stand-in", "case_id": "case-b", "status": "fail"}]
    markdown = (tmp_path / "newer" / "report.md").read_text()
    assert "### New failures (1)" in markdown and "### Metrics that moved (0)" in markdown


def test_compare_to_a_file_that_is_not_a_report_is_a_harness_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(CHECK_PACKAGES, "stand-in", "stand_in_check")
    (tmp_path / "report.json").write_text("{}")
    assert cli.main(["gate", "--check", "stand-in", "--compare-to", str(tmp_path / "report.json")]) == 2
    assert "cannot read it as a paritykit report.json" in capsys.readouterr().err


def test_under_torchrun_only_the_reporting_rank_prints(monkeypatch, capsys):
    monkeypatch.setitem(CHECK_PACKAGES, "stand-in", "stand_in_check")
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)
    from paritykit.dist import launched_by_torchrun

    assert launched_by_torchrun()
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", "/nonexistent"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "paritykit gate:" not in captured.err
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", "/nonexistent"]) == 0
    captured = capsys.readouterr()
    assert "stand-in   ok" in captured.out and "paritykit gate: stand-in done" in captured.err


def test_an_internal_error_of_the_cli_is_a_harness_error(monkeypatch, capsys):
    monkeypatch.setitem(CHECK_PACKAGES, "stand-in", "stand_in_check")
    monkeypatch.setattr(cli, "environment", lambda: 1 / 0)
    assert cli.main(["gate", "--check", "stand-in", "--known-issues", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "internal error (a harness error)" in err and "ZeroDivisionError: division by zero" in err


_DRIVER = """
import sys, contextlib
from paritykit.checks import CHECK_PACKAGES
from paritykit.gate import cli
from paritykit.gate.gating import run_checks
CHECK_PACKAGES["stand-in"] = "stand_in_check"
if sys.argv[1] == "unguarded":
    cli.hypothesis_storage_outside_cwd = contextlib.nullcontext
# A property over text makes hypothesis cache its unicode tables in its storage directory.
import stand_in_check
from hypothesis import strategies as st
stand_in_check.st.integers = lambda *a, **k: st.text(min_size=1).map(len)
sys.exit(cli.main(["gate", "--check", "stand-in", "--known-issues", "/nonexistent", "--examples", "3"]))
"""


@pytest.mark.parametrize("mode", ["guarded", "unguarded"])
def test_the_gate_leaves_no_hypothesis_directory_in_the_current_directory(tmp_path, mode):
    env = {**os.environ, "PYTHONPATH": str(TESTS), OUTCOME_ENV: "property"}
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    subprocess.run([sys.executable, "-c", _DRIVER, mode], cwd=tmp_path, env=env, check=True, capture_output=True)
    # The unguarded run is the negative control: hypothesis does write there.
    assert (tmp_path / ".hypothesis").exists() is (mode == "unguarded")


def test_selftest_counts_a_plant_only_when_the_clean_run_does_not_fail_the_same_way(monkeypatch):
    monkeypatch.setitem(CHECK_PACKAGES, "stand-in", "stand_in_check")
    monkeypatch.setenv(OUTCOME_ENV, "fail")  # case-b fails on the clean stack too
    config = GateConfig(world_sizes=(2,), examples=2, shrink=False)
    clean = run_clean("stand-in", config, pools=None)
    assert [r.status for r in clean.results] == ["pass", "fail"]
    stand_in_check.RAN.clear()
    same = run_plant("stand-in-changes-nothing", config, None, clean)
    assert same.verdict == NOT_CAUGHT_SAME_WAY and same.evidence == "first line"
    assert stand_in_check.RAN == ["case-a", "case-b"]  # no new failure: the whole check ran
    stand_in_check.RAN.clear()
    caught = run_plant("stand-in-breaks-case-a", config, None, clean)
    assert caught.verdict == "caught" and caught.evidence == "case-a broken by a plant"
    assert stand_in_check.RAN == ["case-a"]  # its first new failure answered: case-b did not run


def test_a_planted_failure_the_known_issues_excuse_gets_the_whole_check_run_again(monkeypatch, tmp_path):
    from paritykit.gate import selftest

    monkeypatch.setitem(CHECK_PACKAGES, "stand-in", "stand_in_check")
    monkeypatch.setenv(OUTCOME_ENV, "fail")
    known = tmp_path / "known.toml"
    known.write_text('[[issue]]\ncheck = "stand-in"\ncase = "case-a"\nreason = "listed"\nversions = { torch = "*" }\n')
    monkeypatch.setattr(selftest, "run_checks", lambda names, config, pools: run_checks(names, config, pools, known))
    config = GateConfig(world_sizes=(2,), examples=2, shrink=False)
    clean = run_clean("stand-in", config, pools=None)
    stand_in_check.RAN.clear()
    outcome = run_plant("stand-in-breaks-case-a", config, None, clean)
    # The first run stopped at case-a's failure, which the known issues then excused: the verdict is the
    # whole run's, where case-b fails as in the clean run.
    assert stand_in_check.RAN == ["case-a", "case-a", "case-b"]
    assert outcome.verdict == NOT_CAUGHT_SAME_WAY


def test_a_real_check_draws_the_same_cases_for_the_same_seed_and_replays_one_alone(rank_pools):
    from dataclasses import replace

    from paritykit.gate.gating import run_checks

    config = GateConfig(world_sizes=(1,), examples=4, seed=7)
    first, _ = run_checks(["td-kjt"], config, rank_pools)
    second, _ = run_checks(["td-kjt"], config, rank_pools)
    ids = [r.case_id for r in first]
    assert len(ids) >= 6 and ids == [r.case_id for r in second]
    assert all(r.status in ("pass", "known-issue") for r in first), [r.message for r in first if r.status not in ("pass", "known-issue")]
    sharded = next(r for r in first if r.case_id.startswith("sharded ") and r.status == "pass")
    alone, _ = run_checks(["td-kjt"], replace(config, case=sharded.short_id), rank_pools)
    assert [(r.case_id, r.status) for r in alone] == [(sharded.case_id, "pass")]


def test_a_hypothesis_test_run_before_in_the_same_process_does_not_change_the_drawn_cases():
    # Hypothesis caches the literals it mines from loaded modules per kind of draw; a plain @given test
    # with mining on (a user's suite, or this one) used to leak them into the gate's draws.
    from hypothesis import HealthCheck, given, settings

    from paritykit.checks.runner import run_property
    from paritykit.checks.sharding.draws import sharding_cases
    from paritykit.checks.sharding.matrix import placements_by_module

    def drawn() -> list[str]:
        seen: list[str] = []
        run_property("sharding", sharding_cases(3, placements_by_module("cpu")), lambda case: seen.append(case.case_id()) or {},
                     GateConfig(examples=40, seed=0, shrink=False), case_id=lambda case: case.case_id())
        return seen

    before = drawn()

    @settings(max_examples=300, database=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(sharding_cases(3, placements_by_module("cpu")))
    def plain(case):
        pass

    plain()
    assert drawn() == before
