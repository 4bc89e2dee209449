"""run_property: every example becomes a case; a failure is shrunk and reported once with a replay."""

from hypothesis import strategies as st

from paritykit.checks.results import short_case_id
from paritykit.checks.runner import NOT_RUN_ANSWERED, GateConfig, result_from_exception, run_case, run_property, stop_once
from paritykit.errors import HarnessError, ParityError, RankFailure, UnsupportedByTorchrec


def body(value):
    if value == 7:
        raise UnsupportedByTorchrec("torchrec refuses 7")
    if value > 50:
        raise ParityError(f"{value} differs")
    return {"value": value}


def test_every_example_passes_with_its_metrics():
    results = run_property("demo", st.integers(0, 50).filter(lambda v: v != 7), body, GateConfig(examples=10, seed=1))
    assert len(results) >= 5
    assert all(r.status == "pass" and r.metrics["value"] == int(r.case_id) for r in results)


def test_failure_is_reported_once_as_its_first_failing_case_with_the_shrunk_minimal_one_and_a_replay():
    results = run_property("demo", st.integers(0, 1000), body, GateConfig(examples=50, seed=3))
    failures = [r for r in results if r.status == "fail"]
    assert len(failures) == 1
    first = int(failures[0].case_id)
    assert first > 50 and failures[0].message.startswith(f"{first} differs")
    # The minimal failing case hypothesis shrank it to is named under it.
    assert "shrank it to a smaller failing case: 51\n51 differs" in failures[0].message
    replay = failures[0].replay
    assert "paritykit gate --check demo" in replay and "--seed 3" in replay
    assert f"--case {short_case_id('demo', str(first))}" in replay


def test_unsupported_is_reported_apart_from_failures_and_explicit_examples_run_first():
    results = run_property("demo", st.integers(0, 5), body, GateConfig(examples=3), explicit=(7, 2))
    assert [(r.case_id, r.status) for r in results[:2]] == [("7", "unsupported"), ("2", "pass")]


def test_without_shrinking_the_first_failure_is_reported():
    results = run_property("demo", st.just(900), body, GateConfig(examples=2, shrink=False))
    assert [r.case_id for r in results if r.status == "fail"] == ["900"]


def test_once_a_result_answers_the_run_the_cases_after_it_are_not_run():
    ran = []

    def recording(value):
        ran.append(value)
        return body(value)

    with stop_once(lambda r: r.status == "fail") as run:
        results = run_property("demo", st.integers(0, 1000), recording, GateConfig(examples=20, shrink=False), explicit=(3, 60, 4))
        after = run_case("demo", "later", GateConfig(), lambda: ran.append("later"))
    assert run.hit and ran == [3, 60]
    assert [(r.case_id, r.status) for r in results] == [("3", "pass"), ("60", "fail")]
    assert after.status == "skip" and after.message == NOT_RUN_ANSWERED
    # Outside the block every case runs again.
    assert run_case("demo", "later", GateConfig(), lambda: ran.append("later")).status == "pass" and ran[-1] == "later"


def test_exception_kinds_map_to_statuses():
    def status(exc):
        return result_from_exception("c", "id", "r", exc, 0.0).status

    assert status(ParityError("x")) == "fail"
    assert status(RankFailure("rank 1 killed by SIGABRT")) == "fail"
    assert status(UnsupportedByTorchrec("no")) == "unsupported"
    assert status(HarnessError("no gpu")) == "error"
    assert status(ZeroDivisionError("inside torchrec")) == "fail"


def test_a_known_broken_case_is_a_skip_saying_why_under_torchrun_and_the_known_issue_is_not_called_stale():
    # A LauncherGroup stand-in (object.__new__: no torchrun here); the real launch is in test_dist_launcher.
    from paritykit.checks.known_issues import KnownIssue, apply
    from paritykit.checks.runner import NOT_UNDER_TORCHRUN, run_known_broken_case
    from paritykit.dist import LauncherGroup

    ran = []
    result = run_known_broken_case("sharding", "known-broken rule-x case", GateConfig(), object.__new__(LauncherGroup),
                                   lambda: ran.append(1))
    assert (result.status, result.message, ran) == ("skip", NOT_UNDER_TORCHRUN, [])
    issue = KnownIssue(check="sharding", case="known-broken rule-x *", reason="r", versions={"torchrec": ">=1.0"})
    judgement = apply([result], [issue], {"torchrec": "1.8.0"})
    assert judgement.stale == [] and judgement.cases[0].status == "skip"
    # Without the launcher the body runs and its outcome is reported as it is.
    assert run_known_broken_case("sharding", "c", GateConfig(), None, lambda: {"ran": 1}).status == "pass"
