"""The messages ranks send back to the process that owns them, by name rather than by position.

Parent -> rank: a pickled ``CallRequest``, or ``STOP`` (empty bytes) to stop.
Rank -> parent: ``Ready`` or ``InitError`` once, then one ``Returned`` or ``Raised`` per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STOP = b""


@dataclass
class RankError:
    """An exception raised on one rank, as text (the exception object may not unpickle in the parent).

    kind: "parity", "unsupported", "harness" (keep their type across the process boundary) or
    "exception" (anything else).
    """

    kind: str
    message: str
    traceback: str
    # Where the numbers first went apart (paritykit.errors.Divergence.to_dict()) and what ran, as data.
    divergence: dict | None = None
    configuration: Any = None


@dataclass
class CallRequest:
    """A call to run: the caller's import path (so functions from test files unpickle) and the pickled Call."""

    sys_path: list[str]
    call_bytes: bytes


@dataclass
class Ready:
    pid: int
    startup_s: float
    peak_rss_bytes: int = 0


@dataclass
class InitError:
    error: RankError


@dataclass
class Returned:
    call_id: int
    result: Any
    dist_state: tuple[int, int]
    # The rank's peak resident memory so far: what the pool's capacity estimate learns from.
    peak_rss_bytes: int = 0


@dataclass
class Raised:
    call_id: int
    error: RankError
    dist_state: tuple[int, int] | None
    peak_rss_bytes: int = 0
