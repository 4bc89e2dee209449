"""One call of a function on every rank: what travels to the ranks, and how a rank runs it.

Shared by the spawned pool's workers and by the ranks of a torchrun launch, so both run a
function the same way: the caller's carried contexts entered (``paritykit.harness.call_context``:
planted bugs, for one), every RNG seeded, per-call state restored.
"""

from __future__ import annotations

import io
import pickle
import random
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from paritykit.dist.messages import RankError
from paritykit.errors import HarnessError, ParityError, UnsupportedByTorchrec
from paritykit.harness import call_context

DEFAULT_SEED = 0

# Exception types that keep their meaning when they cross from a rank to the parent: a parity
# failure stays a ParityError, a refused configuration stays UnsupportedByTorchrec.
_KIND_BY_TYPE = ((ParityError, "parity"), (UnsupportedByTorchrec, "unsupported"), (HarnessError, "harness"))


@dataclass
class Call:
    """A function call to run on every rank."""

    call_id: int
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    seed: int = DEFAULT_SEED
    case: str | None = None
    # What the caller's process carries to the ranks (call_context.capture()), captured at creation.
    contexts: tuple = field(default_factory=call_context.capture)

    def describe(self) -> str:
        case = f" case {self.case!r}" if self.case else ""
        carried = f" with {', '.join(repr(state) for _, state in self.contexts)}" if self.contexts else ""
        return f"call #{self.call_id} {function_name(self.fn)}{case} seed {self.seed}{carried}"


def function_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)


def rank_error_from(exc: BaseException) -> RankError:
    """What a rank reports of an exception, decided here while its traceback still exists: a typed
    paritykit exception keeps its kind; any other is "harness" when paritykit's own code raised it
    (``paritykit.errors.raised_by_harness``), else "exception" (the code under test: a RankFailure)."""
    from paritykit.errors import raised_by_harness

    from paritykit.errors import crash_divergence

    kind = next((name for cls, name in _KIND_BY_TYPE if isinstance(exc, cls)), "exception")
    text = "".join(traceback.format_exception(exc)).rstrip()
    if kind == "exception" and raised_by_harness(exc):
        return RankError("harness", f"harness error (raised in paritykit's own code): {type(exc).__name__}: {exc}", text)
    divergence = getattr(exc, "divergence", None) or (crash_divergence(exc) if kind == "exception" else None)
    return RankError(kind, f"{type(exc).__name__}: {exc}", text, divergence=divergence.to_dict() if divergence else None,
                     configuration=getattr(exc, "configuration", None))


def execute(call: Call) -> Any:
    """Run ``call`` in this process with its seed and carried contexts; restore what it may change."""
    import torch

    grad_enabled = torch.is_grad_enabled()
    default_dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        with call_context.entered(call.contexts):
            seed_everything(call.seed)
            return call.fn(*call.args, **call.kwargs)
    finally:
        torch.set_grad_enabled(grad_enabled)
        torch.set_default_dtype(default_dtype)
        torch.use_deterministic_algorithms(deterministic)


class _CpuPickler(pickle.Pickler):
    """Pickles results with every tensor as a CPU copy, so the parent needs no device."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        import torch

        self._tensor_type = torch.Tensor

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, self._tensor_type) and obj.device.type != "cpu":
            return _cpu_tensor, (obj.detach().cpu(),)
        return NotImplemented


def _cpu_tensor(tensor: Any) -> Any:
    return tensor


def dumps_with_cpu_tensors(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _CpuPickler(buffer).dump(obj)
    return buffer.getvalue()


def add_to_sys_path(entries: list[str]) -> None:
    """Make the caller's import path visible here, so functions from test files unpickle."""
    missing = [entry for entry in entries if entry not in sys.path]
    if missing:
        sys.path[:0] = missing


class RunShortcuts:
    """``run`` and ``run_seeded`` in terms of a class's ``call``: the same API for every kind of ranks."""

    def call(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, **options: Any) -> list[Any]:
        raise NotImplementedError

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank (seeded with the default seed); results in rank order."""
        return self.call(fn, args, kwargs)

    def run_seeded(self, seed: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Like run(), with random/numpy/torch seeded with ``seed`` on every rank first."""
        return self.call(fn, args, kwargs, seed=seed)
