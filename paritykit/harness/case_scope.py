"""Which case is running now, for whoever measures per case (the coverage instrument).

The runner wraps every case body in ``case_scope(label)`` (the check and the case's short id); listeners registered with
``add_listener`` hear each change (the label, or None when no case runs). Nothing here knows who
listens, so the checks stay ignorant of the instruments that watch them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

Listener = Callable[["str | None"], None]

_listeners: list[Listener] = []
_stack: list[str] = []


def add_listener(listener: Listener) -> None:
    if listener not in _listeners:
        _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def current() -> str | None:
    """The label of the innermost running case, or None."""
    return _stack[-1] if _stack else None


@contextlib.contextmanager
def case_scope(label: str) -> Iterator[None]:
    _stack.append(label)
    _notify(label)
    try:
        yield
    finally:
        _stack.pop()
        _notify(current())


def _notify(label: str | None) -> None:
    for listener in list(_listeners):
        listener(label)
