"""A stand-in check whose outcome a test chooses: it exercises the gate's plumbing (exit codes,
known issues, report files, replays, the self-test's judgement) independently of any real check.
Real checks are tested elsewhere. Its failures come from real code: paritykit's own conversion for
a harness defect, torchrec's KeyedJaggedTensor for a failure of the code under test."""

import contextlib
import os

import torch
from hypothesis import strategies as st

import paritykit.convert as convert
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import CheckEntry, run_case, run_property
from paritykit.errors import HarnessError, NothingCompared, ParityError
from paritykit.harness.plants import register

NAME = "stand-in"
OUTCOME_ENV = "PARITYKIT_STAND_IN_OUTCOME"
METRIC_ENV = "PARITYKIT_STAND_IN_METRIC"
# Property mode: examples above this value fail.
FAIL_ABOVE_ENV = "PARITYKIT_STAND_IN_FAIL_ABOVE"

# Case ids whose bodies ran in this process, in order (what --case must limit to one).
RAN: list[str] = []
_broken: list[str] = []


def paritykit_defect():
    """paritykit's own conversion raising on inputs it should never be given (a harness defect)."""
    return convert._lengths_from_offsets([torch.tensor([0, 1, 2])], None, False)


def torchrec_defect():
    """torchrec raising inside its own code: lengths sum to 5, there are 4 values."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.arange(4), torch.tensor([2, 3])).to_dict()


def _case_b(outcome):
    RAN.append("case-b")
    if outcome == "fail":
        raise ParityError("first line\nsecond line")
    if outcome == "empty":
        raise NothingCompared("zero batches")
    return {}


def _case_a():
    RAN.append("case-a")
    if "case-a" in _broken:
        raise ParityError("case-a broken by a plant")
    if outcome() == "empty":
        raise NothingCompared("nothing drawn")
    return {"max_abs_error": float(os.environ.get(METRIC_ENV, "0.0"))}


def outcome() -> str:
    return os.environ.get(OUTCOME_ENV, "pass")


def _property_body(value: int):
    RAN.append(str(value))
    if value > int(os.environ.get(FAIL_ABOVE_ENV, "1000000000")):
        raise ParityError(f"{value} differs")
    return {"value": value}


def run(config, pools):
    chosen = outcome()
    if chosen == "harness-error":
        raise HarnessError("stand-in could not run")
    if chosen == "paritykit-bug":
        paritykit_defect()
    if chosen == "torchrec-bug":
        torchrec_defect()
    if chosen == "property":
        return run_property(NAME, st.integers(0, 10_000), _property_body, config, case_id=str)
    results = [run_case(NAME, "case-a", config, _case_a)]
    if chosen in ("fail", "empty"):
        results.append(run_case(NAME, "case-b", config, lambda: _case_b(chosen)))
        return results
    return results + [CaseResult(NAME, "case-b", chosen, replay=config.replay(NAME), message="first line\nsecond line")]


@contextlib.contextmanager
def _breaking(case: str):
    _broken.append(case)
    try:
        yield
    finally:
        _broken.remove(case)


@register("stand-in-breaks-case-a", check=NAME)
def breaks_case_a():
    """Makes case-a fail: a failure the clean run does not have."""
    return _breaking("case-a")


@register("stand-in-changes-nothing", check=NAME)
def changes_nothing():
    """Changes nothing: whatever fails, fails in the clean run too."""
    return contextlib.nullcontext()


CHECK = CheckEntry(NAME, plants=__name__, run=run)
