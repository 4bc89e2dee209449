"""A stand-in check whose outcome a test chooses: it exercises the gate's plumbing (exit codes,
known issues, report files) independently of any real check. Real checks are tested elsewhere."""

import os

from paritykit.errors import HarnessError
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import CheckEntry

NAME = "stand-in"
OUTCOME_ENV = "PARITYKIT_STAND_IN_OUTCOME"


def run(config, pools):
    outcome = os.environ.get(OUTCOME_ENV, "pass")
    if outcome == "harness-error":
        raise HarnessError("stand-in could not run")
    return [
        CaseResult(NAME, "case-a", "pass", replay=config.replay(NAME), metrics={"max_abs_error": 0.0}),
        CaseResult(NAME, "case-b", outcome, replay=config.replay(NAME), message="first line\nsecond line"),
    ]


CHECK = CheckEntry(NAME, plants=__name__, run=run)
