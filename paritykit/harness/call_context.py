"""What a call carries from the caller's process into every rank, without the ranks knowing what.

A *capturer* registered here is asked, each time a function is sent to ranks, for the state to
carry: it returns ``(enter, state)`` or None. ``enter`` must be a module-level function (it is
pickled by reference, so the rank imports its module); on the rank the call runs inside
``enter(state)``. The planted-bug registry uses it so that a plant active in the caller is active
on every rank, while the rank machinery (``paritykit.dist``) imports nothing of the plants.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

Enter = Callable[[Any], ContextManager[Any]]
Capturer = Callable[[], "tuple[Enter, Any] | None"]

_capturers: list[Capturer] = []


def register(capturer: Capturer) -> Capturer:
    """Add ``capturer`` (once); returns it, so it can be used as a decorator."""
    if capturer not in _capturers:
        _capturers.append(capturer)
    return capturer


def capture() -> tuple[tuple[Enter, Any], ...]:
    """The contexts to carry with a call made now."""
    return tuple(context for context in (capturer() for capturer in _capturers) if context is not None)


@contextlib.contextmanager
def entered(contexts: tuple[tuple[Enter, Any], ...]) -> Iterator[None]:
    """Run the block inside every carried context, in order."""
    with contextlib.ExitStack() as stack:
        for enter, state in contexts:
            stack.enter_context(enter(state))
        yield
