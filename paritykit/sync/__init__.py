"""Sync guards: count and budget device->host synchronizations, with their call sites.

    with count_syncs() as rec:          # backend="auto": "cuda" when CUDA is available, else "cpu"
        ebc(kjt)
    rec.total, rec.by_kind, rec.by_site

    with sync_guard(max_syncs=0):       # or @sync_guard(max_syncs=0) on a function
        ebc(kjt)                        # over budget: ParityError naming the call sites

Two backends sit behind one API: ``cuda`` (torch's sync debug mode, see paritykit.sync.cuda) and
``cpu``, a proxy that counts the host reads that would synchronize if the tensors lived on a GPU
(see paritykit.sync.cpu for which tensors stand for device tensors in a CPU run, and why the
counts match the CUDA backend's on the budget corpus). Both name their kinds with
``paritykit.sync.kinds``, and ``paritykit.sync.sites`` says how a call site is chosen. ``on_host(...)`` declares data prepared on
the host, so that a device-neutral test reads the same on both backends.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from paritykit.errors import Divergence, HarnessError, ParityError
from paritykit.sync.sites import locate, stack_lines

BACKENDS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class SyncEvent:
    """One synchronization: its kind, where it happened and, on demand, the whole stack."""

    kind: str
    site: str
    user_site: str | None
    torchrec_site: str | None
    stack: tuple[str, ...] | None = None


@dataclass
class SyncRecord:
    """What a count_syncs/sync_guard block saw. Complete once the block has exited."""

    backend: str
    events: list[SyncEvent] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.events)

    @property
    def by_kind(self) -> dict[str, int]:
        return dict(sorted(Counter(e.kind for e in self.events).items()))

    @property
    def by_site(self) -> dict[str, int]:
        return dict(Counter(e.site for e in self.events).most_common())

    def describe(self, limit: int = 20) -> str:
        """One line per distinct (kind, site, caller), most frequent first."""
        groups = Counter((e.kind, e.site, e.user_site) for e in self.events)
        lines = []
        for (kind, site, user_site), count in groups.most_common(limit):
            caller = f" (called from {user_site})" if user_site and user_site != site else ""
            lines.append(f"  {count}x {kind} at {site}{caller}")
        if len(groups) > limit:
            lines.append(f"  ... and {len(groups) - limit} more call sites")
        return "\n".join(lines)

    def stacks(self) -> list[tuple[str, ...]]:
        """The full stack of each event; only recorded with ``stacks=True``."""
        if any(e.stack is None for e in self.events):
            raise HarnessError("stacks were not recorded: open the block with stacks=True")
        return [e.stack for e in self.events]  # type: ignore[misc]


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"sync backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return backend


def _backend_module(name: str):
    if name == "cuda":
        import paritykit.sync.cuda as module
    else:
        import paritykit.sync.cpu as module
    return module


# --- sessions ---------------------------------------------------------------------------------

class _Session:
    """One open block: attaches to a backend and turns its raw events into SyncEvents."""

    def __init__(self, backend: str, stacks: bool) -> None:
        self.backend = resolve_backend(backend)
        self.stacks = stacks
        self.record = SyncRecord(backend=self.backend)
        self._module = _backend_module(self.backend)

    def on_sync(self, kind: str) -> None:
        frame = sys._getframe(1)
        site, user_site, torchrec_site, first = locate(frame)
        if not kind:
            from paritykit.sync.cuda import classify_frame

            kind = classify_frame(first)
        stack = stack_lines(frame) if self.stacks else None
        self.record.events.append(SyncEvent(kind, site, user_site, torchrec_site, stack))

    def open(self) -> SyncRecord:
        self._module.attach(self.on_sync)
        return self.record

    def close(self) -> None:
        self._module.detach(self.on_sync)


class count_syncs:
    """``with count_syncs(backend="auto", stacks=False) as rec:`` counts the syncs of the block.

    ``rec`` is a SyncRecord (total, by_kind, by_site, describe(), stacks()). Blocks nest: an outer
    block also counts what an inner one sees.
    """

    def __init__(self, backend: str = "auto", *, stacks: bool = False) -> None:
        resolve_backend(backend)  # bad input fails here, not at entry
        self._backend = backend
        self._stacks = stacks
        self._session: _Session | None = None

    def __enter__(self) -> SyncRecord:
        if self._session is not None:
            raise HarnessError("a count_syncs block cannot be entered twice at once; make a new one")
        self._session = _Session(self._backend, self._stacks)
        return self._session.open()

    def __exit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        assert session is not None
        session.close()


class sync_guard(contextlib.ContextDecorator):
    """Fail with ParityError when the block (or decorated function) makes more than ``max_syncs`` syncs.

    The error names the kinds and call sites. An exception raised by the block itself wins over the
    budget check. As a decorator, every call is counted on its own (recursion included).
    """

    def __init__(self, max_syncs: int = 0, backend: str = "auto", *, stacks: bool = False) -> None:
        if isinstance(max_syncs, bool) or not isinstance(max_syncs, int) or max_syncs < 0:
            raise ValueError(f"max_syncs must be a non-negative int, got {max_syncs!r}")
        resolve_backend(backend)
        self.max_syncs = max_syncs
        self._backend = backend
        self._stacks = stacks
        self._sessions: list[_Session] = []
        self.record: SyncRecord | None = None

    def _recreate_cm(self) -> "sync_guard":
        return self

    def __enter__(self) -> SyncRecord:
        session = _Session(self._backend, self._stacks)
        self._sessions.append(session)
        return session.open()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        session = self._sessions.pop()
        session.close()
        self.record = session.record
        if exc_type is None:
            check_budget(session.record, self.max_syncs)


def check_budget(record: SyncRecord, max_syncs: int, what: str = "the guarded block") -> None:
    """Raise ParityError naming the call sites when ``record`` holds more than ``max_syncs`` syncs."""
    if record.total <= max_syncs:
        return
    kinds = ", ".join(f"{kind}: {count}" for kind, count in record.by_kind.items())
    sites = ", ".join(record.by_site)
    raise ParityError(
        f"sync budget exceeded in {what}: {record.total} synchronization(s), budget {max_syncs} "
        f"(backend {record.backend}; {kinds})\n{record.describe()}",
        divergence=Divergence("syncs", "device->host synchronizations", "sync budget",
                              detail=f"{what}: {record.total} syncs, budget {max_syncs}, at {sites}"),
    )


# --- host data ----------------------------------------------------------------------------

def on_host(obj: Any) -> Any:
    """Declare data prepared on the host (tensors, JaggedTensor, KeyedJaggedTensor, dicts/lists of them).

    For the CPU proxy the CPU tensors inside come back as host-standing aliases (same storage);
    reading them is never a sync, and ``.to(device)`` moves them to the (stand-in) device. On a
    GPU run they are real host tensors already, and the aliases behave like them.
    """
    import torch

    from paritykit.sync.cpu import mark_host

    if isinstance(obj, torch.Tensor):
        return mark_host(obj)
    if isinstance(obj, dict):
        return type(obj)((k, on_host(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_host(v) for v in obj)
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

    if isinstance(obj, (JaggedTensor, KeyedJaggedTensor)):
        import copy

        marked = copy.copy(obj)
        # A VBE KJT's stride_per_key_per_rank is host data whatever the device (torchrec makes it
        # with device="cpu"); declaring it keeps reads of the strides off the count.
        for name in ("_values", "_weights", "_lengths", "_offsets", "_stride_per_key_per_rank"):
            value = getattr(obj, name, None)
            if value is not None:
                setattr(marked, name, mark_host(value))
        if getattr(obj, "_jt_dict", None) is not None:
            marked._jt_dict = None  # a cache of views of the unmarked tensors
        return marked
    raise TypeError(
        f"on_host takes tensors, JaggedTensor, KeyedJaggedTensor and dicts/lists/tuples of them, got {type(obj).__name__}"
    )
