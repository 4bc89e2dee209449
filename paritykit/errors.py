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
from dataclasses import dataclass
from types import TracebackType


# Where a difference first showed: an output before any update, the tables after a training step
# (the gradient, the optimizer's update, or either when the numbers cannot tell them apart), the
# state only compared at the end, the steps a pipeline ran, a sync budget, no numbers at all (the
# code under test raised), or a difference its comparison did not locate.
STAGES = ("forward", "backward", "update", "backward or update", "final state", "schedule", "syncs", "crash", "unlocated")


@dataclass(frozen=True)
class Divergence:
    """Where two paths that should agree first went apart, as data: what differs (``what``: an
    embedding output, the model's output, a table, the optimizer state, ...), at which ``stage`` and
    ``step``, in which module, table, feature and shard, on which rank, for which placement
    (``traits``: what every differing table shares, such as ``sharding=row_wise``) and comparison
    (``path``: "sharded vs unsharded", "TensorDict vs KJT", ...). The gate groups failures with the
    same divergence into one finding; the message of the error carrying it says the same in words."""

    stage: str
    what: str
    path: str = ""
    step: int | None = None
    rank: int | None = None
    module: str = ""
    table: str = ""
    feature: str = ""
    shard: str = ""
    placement: str = ""
    traits: tuple[str, ...] = ()
    element: str = ""
    detail: str = ""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"Divergence.stage must be one of {STAGES}, got {self.stage!r}")
        object.__setattr__(self, "traits", tuple(self.traits))

    def location(self) -> str:
        """"step 0, forward: embedding output of module 'ebc', table 't0' (row_wise MEAN fused), feature 'f0', element [1, 2], rank 1"."""
        where = [f"step {self.step}" if self.step is not None else "", self.stage]
        named = [f"module {self.module!r}" if self.module else "",
                 f"table {self.table!r}" + (f" ({self.placement})" if self.placement else "") if self.table else "",
                 f"feature {self.feature!r}" if self.feature else "", f"shard {self.shard}" if self.shard else "",
                 f"element {self.element}" if self.element else "", f"rank {self.rank}" if self.rank is not None else ""]
        text = ", ".join(part for part in where if part) + f": {self.what}"
        named_text = ", ".join(part for part in named if part)
        return text + (f" of {named_text}" if named_text else "") + (f" ({self.path})" if self.path else "")

    @property
    def phase(self) -> str:
        """The stage as far as grouping goes: a training step's gradient and update are one phase (the
        numbers alone cannot always tell them apart, and a run recorded only at its end cannot)."""
        return "training step" if self.stage in ("backward", "update", "backward or update", "final state") else self.stage

    def cause(self) -> tuple[str, str, str, str]:
        """What two divergences share when they are one cause: the phase, what differs, the comparison
        and, for a crash, the function of the code under test that raised."""
        return (self.phase, self.what, self.path, self.module if self.stage == "crash" else "")

    def to_dict(self) -> dict:
        return {name: (list(value) if isinstance(value, tuple) else value) for name, value in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: dict) -> "Divergence":
        known = {name for name in cls.__dataclass_fields__}
        return cls(**{key: value for key, value in data.items() if key in known})


class ParityError(AssertionError):
    """Two paths that should agree do not. The message alone locates the difference; ``divergence``
    says where the numbers first went apart (as data) and ``configuration`` what ran (the data a
    standalone reproduction is written from), where the comparison that raised it knows them."""

    def __init__(self, *args: object, divergence: Divergence | None = None, configuration: object = None) -> None:
        super().__init__(*args)
        self.divergence = divergence
        self.configuration = configuration

    def __reduce__(self):
        # Keyword-only fields and attributes set later survive pickling (ranks, xdist workers).
        return (_rebuilt, (type(self), self.args, dict(self.__dict__)))


def expect(condition: bool, what: str) -> None:
    """A check's one expectation: ParityError saying ``what`` unless ``condition`` holds."""
    if not condition:
        raise ParityError(what)


def _rebuilt(cls: type, args: tuple, state: dict) -> BaseException:
    exc = cls(*args)
    exc.__dict__.update(state)
    return exc


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
    decides. Two refinements: paritykit code that a planted bug calls (a plant wrapping paritykit's
    own conversion) belongs to the plant; paritykit code that the code under test had torch.fx trace
    (a built-in model's forward under torchrec's pipeline tracer) belongs to the code under test. Typed exceptions keep their meaning: HarnessError is the
    harness's, ParityError/RankFailure/UnsupportedByTorchrec/NothingCompared are not.
    """
    if isinstance(exc, HarnessError):
        return True
    if isinstance(exc, (ParityError, RankFailure, UnsupportedByTorchrec, NothingCompared)):
        return False
    modules = _frame_modules(exc.__traceback__)
    names = [name for name in modules if frame_owner(name) != "platform"]
    if not names or frame_owner(names[-1]) == "under-test":
        return False
    # The innermost frames are paritykit's: a planted bug right outside them claims them.
    entered_from = next((name for name in reversed(names) if frame_owner(name) != "harness"), "")
    return not _is_plant(entered_from) and not _traced_by_code_under_test(modules)


def _traced_by_code_under_test(modules: list[str]) -> bool:
    """Whether the innermost paritykit frames were being symbolically traced (torch.fx) on behalf of
    the code under test: a model's forward that torchrec's pipeline traced, where torchrec chose what
    to trace into (it must keep modules fx cannot trace as leaves)."""
    caller, first_harness = None, None
    for index in range(len(modules) - 1, -1, -1):  # innermost first
        owner = frame_owner(modules[index])
        if owner == "harness":
            first_harness = index
        elif owner == "under-test":
            caller = index
            break
    if caller is None or first_harness is None:
        return False
    return any(name.startswith("torch.fx") for name in modules[caller + 1:first_harness])


def _frame_modules(tb: TracebackType | None) -> list[str]:
    """The module of every frame of a traceback, outermost first."""
    return [str(frame.f_globals.get("__name__") or "") for frame, _line in traceback.walk_tb(tb)]


def crash_divergence(exc: BaseException) -> Divergence:
    """The divergence of a failure without numbers (the code under test raised), located at the
    innermost frame of the code under test; decided while the traceback exists."""
    frames = [(str(frame.f_globals.get("__name__") or ""), frame.f_code.co_name, line)
              for frame, line in traceback.walk_tb(exc.__traceback__)]
    under_test = [frame for frame in frames if frame_owner(frame[0]) == "under-test"]
    module, function, line = under_test[-1] if under_test else (frames[-1] if frames else ("", "", 0))
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return Divergence(stage="crash", what=type(exc).__name__, module=f"{module}.{function}" if module else "",
                      detail=f"line {line}: {text}" if module else text)
