"""Exception types shared by every layer, and the one rule that says whose fault an exception is.

The split matters to the gate's exit codes: a ParityError or a RankFailure is a failure of the
code under test (exit 1); a HarnessError means paritykit could not run the check at all (exit 2);
UnsupportedByTorchrec is neither: torchrec refused the configuration, which is reported on its own;
NothingCompared means a case ran but compared nothing, which is not a pass (reported as a skip).

Any other exception is judged by where it was raised (``raised_by_harness``): in paritykit's own
code it is a harness error; in the code under test (torchrec, fbgemm, a user's model, and
paritykit's planted bugs, which stand for torchrec) it is a failure.
"""

from __future__ import annotations

import sys
import traceback
from types import TracebackType


class ParityError(AssertionError):
    """Two paths that should agree do not. The message alone locates the difference."""


class HarnessError(RuntimeError):
    """The harness or environment could not run a check (missing GPU, bad arguments, a paritykit defect)."""


class UnsupportedByTorchrec(Exception):
    """torchrec rejected a configuration; carries torchrec's own message."""


class RankFailure(RuntimeError):
    """A rank raised, was killed by a signal, or hung. A failure of the code under test."""


class NothingCompared(Exception):
    """A case ran but compared nothing (zero batches, nothing drawn): reported as a skip with this reason."""


class ShimGap(HarnessError, AttributeError):
    """torchrec reached something paritykit's CPU stream shim does not provide.

    An AttributeError too, so that torchrec's own ``hasattr``/``getattr(..., default)`` probes
    behave exactly as without the shim; only a reach that nothing catches surfaces, as a harness error.
    """


# Top-level packages that are neither paritykit nor the code under test: the exception is judged
# by the frame that called into them. torch is here because torchrec and paritykit both call it.
PLATFORM_PACKAGES = frozenset({"torch", "hypothesis", "tensordict", "numpy", "pytest", "_pytest", "pluggy", "typing_extensions"})
PACKAGE = "paritykit"


def frame_owner(module_name: str) -> str:
    """"platform", "harness" (paritykit's own code) or "under-test" (everything else, plants included)."""
    top = module_name.partition(".")[0]
    if not module_name or top in sys.stdlib_module_names or top in PLATFORM_PACKAGES or top.startswith("<"):
        return "platform"
    if top != PACKAGE:
        return "under-test"
    return "under-test" if _is_plant(module_name) else "harness"


def _is_plant(module_name: str) -> bool:
    # Planted bugs live in paritykit/checks/<check>/plants.py and stand for torchrec.
    parts = module_name.split(".")
    return len(parts) == 4 and parts[:2] == [PACKAGE, "checks"] and parts[3] == "plants"


def raised_by_harness(exc: BaseException) -> bool:
    """True when ``exc`` was raised in paritykit's own code rather than in the code under test.

    The innermost frame that is not platform code (stdlib, torch, hypothesis, tensordict, ...)
    decides. One refinement: paritykit code that a planted bug calls (a plant wrapping paritykit's
    own conversion) belongs to the plant. Typed exceptions keep their meaning: HarnessError is the
    harness's, ParityError/RankFailure/UnsupportedByTorchrec/NothingCompared are not.
    """
    if isinstance(exc, HarnessError):
        return True
    if isinstance(exc, (ParityError, RankFailure, UnsupportedByTorchrec, NothingCompared)):
        return False
    names = [name for name in _frame_modules(exc.__traceback__) if frame_owner(name) != "platform"]
    if not names or frame_owner(names[-1]) == "under-test":
        return False
    # The innermost frames are paritykit's: a planted bug right outside them claims them.
    entered_from = next((name for name in reversed(names) if frame_owner(name) != "harness"), "")
    return not _is_plant(entered_from)


def _frame_modules(tb: TracebackType | None) -> list[str]:
    """The module of every frame of a traceback, outermost first."""
    return [str(frame.f_globals.get("__name__") or "") for frame, _line in traceback.walk_tb(tb)]
