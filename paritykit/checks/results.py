"""What every check produces: one CaseResult per case."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATUSES = ("pass", "fail", "error", "skip", "known-issue", "unsupported")


@dataclass
class CaseResult:
    """One case of one check.

    status: pass, fail (parity broken, rank crashed or hung), error (the harness could not
    run it), skip (with a reason in message), known-issue (a listed known failure),
    unsupported (torchrec rejected the configuration; message carries its words).
    """

    check: str
    case_id: str
    status: str
    replay: str = ""
    message: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"CaseResult.status must be one of {STATUSES}, got {self.status!r}")
