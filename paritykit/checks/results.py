"""What every check produces: one CaseResult per case, and the short id that names a case on the command line."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

STATUSES = ("pass", "fail", "error", "skip", "known-issue", "unsupported")
SHORT_ID_LENGTH = 10
# A skip whose message starts so is a case that ran and compared nothing (errors.NothingCompared).
NOTHING_COMPARED = "nothing compared: "


def short_case_id(check: str, case_id: str) -> str:
    """A short, stable name for a case: a hash of its check and its descriptive id.

    The descriptive id is a function of the seed and the arguments, so the short id is too;
    ``paritykit gate --case SHORT_ID`` re-runs that case alone.
    """
    return hashlib.sha256(f"{check}\0{case_id}".encode()).hexdigest()[:SHORT_ID_LENGTH]


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
    # A failure's first divergence (paritykit.errors.Divergence.to_dict()) and the configuration that
    # failed (paritykit.harness.configuration.ShardedConfiguration.to_json()), where the check knows them.
    divergence: dict[str, Any] | None = None
    configuration: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"CaseResult.status must be one of {STATUSES}, got {self.status!r}")

    @property
    def short_id(self) -> str:
        return short_case_id(self.check, self.case_id)

    @property
    def compared_nothing(self) -> bool:
        """A case that ran but compared nothing: not a pass."""
        return self.status == "skip" and self.message.startswith(NOTHING_COMPARED)
