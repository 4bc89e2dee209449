"""The listener registry both sync backends share: hooks exist only while a listener is attached."""

from __future__ import annotations

from typing import Callable

Listener = Callable[[str], None]


class Listeners:
    """Calls ``install`` when the first listener attaches and ``uninstall`` when the last detaches,
    so that with no guard open nothing of the backend is in place (the guard off costs nothing)."""

    def __init__(self, install: Callable[[], None], uninstall: Callable[[], None]) -> None:
        self._install, self._uninstall = install, uninstall
        self._listeners: list[Listener] = []

    def attach(self, listener: Listener) -> None:
        if not self._listeners:
            self._install()
        self._listeners.append(listener)

    def detach(self, listener: Listener) -> None:
        self._listeners.remove(listener)
        if not self._listeners:
            self._uninstall()

    def notify(self, kind: str) -> None:
        for listener in list(self._listeners):
            listener(kind)

    def __bool__(self) -> bool:
        return bool(self._listeners)
