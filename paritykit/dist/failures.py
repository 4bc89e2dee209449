"""The error a failed call raises in the parent, with everything needed to understand and replay it."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from paritykit.dist.calls import RankError
from paritykit.errors import Divergence, HarnessError, ParityError, RankFailure, UnsupportedByTorchrec

_EXCEPTION_BY_KIND = {"parity": ParityError, "unsupported": UnsupportedByTorchrec, "harness": HarnessError}


def signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass
class RankOutcome:
    """What one rank did during a failed call."""

    rank: int
    state: str  # returned | raised | killed | exited | running; under torchrun also gone | alive | unknown
    error: RankError | None = None
    exitcode: int | None = None
    stack: str = ""
    where: str = ""  # under torchrun: "pid P on HOST"

    def summary(self) -> str:
        if self.state == "raised" and self.error is not None:
            return f"rank {self.rank} raised {self.error.message}"
        if self.state == "killed":
            return f"rank {self.rank} was killed by {signal_name(self.exitcode or 0)}"
        if self.state == "exited":
            return f"rank {self.rank} exited with code {self.exitcode}"
        if self.state == "running":
            return f"rank {self.rank} was still running"
        if self.state == "gone":
            return f"rank {self.rank} is gone ({self.where}): its process no longer exists"
        if self.state == "alive":
            return f"rank {self.rank} is alive ({self.where})"
        if self.state == "unknown":
            return f"rank {self.rank} runs on another host ({self.where})"
        return f"rank {self.rank} returned normally"


@dataclass
class FailedCall:
    """A call that did not return on every rank. ``primary`` is the rank whose failure came first."""

    kind: str  # exception | signal | exit | hang | lost (under torchrun: a peer's connection broke)
    call_description: str
    replay: str
    outcomes: list[RankOutcome]
    primary: int | None
    timeout_s: float
    pool_note: str = ""
    details: list[str] = field(default_factory=list)

    def headline(self) -> str:
        if self.kind == "hang":
            running = [o.rank for o in self.outcomes if o.state == "running"]
            return f"ranks {running} did not finish within {self.timeout_s:g} s ({self.call_description})"
        if self.kind == "lost":
            # Which gone rank died first cannot be told from a peer: name them all.
            gone = [o.rank for o in self.outcomes if o.state == "gone"]
            lost = f"ranks {gone}" if gone else "a rank (its connection broke)"
            return f"the launch lost {lost} during {self.call_description}"
        return f"{self.outcomes[self.primary].summary()} during {self.call_description}"

    def message(self) -> str:
        lines = [self.headline(), f"replay: {self.replay}"]
        if self.primary is not None:
            outcome = self.outcomes[self.primary]
            if outcome.error is not None:
                lines += [f"--- rank {outcome.rank} traceback ---", outcome.error.traceback]
            if outcome.stack:
                lines += [f"--- rank {outcome.rank} stack when it died ---", outcome.stack.rstrip()]
        others = [o for o in self.outcomes if o.rank != self.primary]
        if others:
            lines.append("--- the other ranks ---" if self.primary is not None else "--- all ranks ---")
        for outcome in others:
            lines.append(outcome.summary())
            if outcome.error is not None:
                lines.append(_indent(outcome.error.traceback))
            if outcome.stack:
                lines.append(_indent(outcome.stack.rstrip()))
        if self.pool_note:
            lines.append(self.pool_note)
        return "\n".join(lines)

    def to_exception(self) -> Exception:
        """A ParityError, UnsupportedByTorchrec or HarnessError raised on a rank keeps its type; all else is a RankFailure."""
        cls, error = RankFailure, None
        if self.kind == "exception" and self.primary is not None:
            error = self.outcomes[self.primary].error
            cls = _EXCEPTION_BY_KIND.get(error.kind if error else "", RankFailure)
        exc = cls(self.message())
        # The rank's structured finding travels with it (paritykit.errors.Divergence).
        divergence = getattr(error, "divergence", None)
        exc.divergence = Divergence.from_dict(divergence) if divergence else None
        exc.configuration = getattr(error, "configuration", None)
        exc.kind = self.kind
        exc.rank = self.primary
        exc.replay = self.replay
        exc.outcomes = self.outcomes
        exc.stacks = {o.rank: o.stack for o in self.outcomes if o.stack}
        return exc


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
