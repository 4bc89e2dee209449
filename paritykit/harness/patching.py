"""One way to patch an attribute and put it back: every monkeypatch in paritykit goes through here.

Used by the planted bugs, the CPU stream shim, the sync guard's CPU proxy and the lookup/optimizer
overlap emulation. The original is restored exactly: a method defined on the owner itself is put
back as the same object; an attribute the owner only inherited (or lacked) is removed again rather
than copied down onto it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator


@contextlib.contextmanager
def replaced(owner: Any, name: str, make_replacement: Callable[[Any], Any]) -> Iterator[Any]:
    """Set ``owner.name`` to ``make_replacement(original)`` for the block; yields the replacement.

    ``original`` is what ``getattr(owner, name)`` gives (``None`` when the owner has no such
    attribute), so a replacement can wrap it.
    """
    defined_here = name in vars(owner)
    saved = vars(owner)[name] if defined_here else None
    original = getattr(owner, name, None)
    replacement = make_replacement(original)
    setattr(owner, name, replacement)
    try:
        yield replacement
    finally:
        if defined_here:
            setattr(owner, name, saved)
        else:
            try:
                delattr(owner, name)
            except AttributeError:
                pass


@contextlib.contextmanager
def replaced_all(patches: Iterable[tuple[Any, str, Callable[[Any], Any]]]) -> Iterator[None]:
    """``replaced`` for each (owner, name, make_replacement) for the block, all put back after it."""
    with contextlib.ExitStack() as stack:
        for owner, name, make in patches:
            stack.enter_context(replaced(owner, name, make))
        yield


def patched(owner: Any, name: str, value: Any) -> contextlib.AbstractContextManager[Any]:
    """Set ``owner.name`` to ``value`` for the block (``replaced`` without looking at the original)."""
    return replaced(owner, name, lambda _original: value)


class PatchSet:
    """Patches that stay in place between ``install()`` and ``uninstall()`` (not a single block).

    The sync guard's CPU proxy installs its hooks when the first guard opens and removes them when
    the last one closes; the patches themselves are ``replaced`` blocks held open in between.
    """

    def __init__(self, patches: Callable[[], list[tuple[Any, str, Callable[[Any], Any]]]]) -> None:
        self._patches = patches
        self._stack: contextlib.ExitStack | None = None

    def install(self) -> None:
        stack = contextlib.ExitStack()
        try:
            for owner, name, make in self._patches():
                stack.enter_context(replaced(owner, name, make))
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def uninstall(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    @property
    def installed(self) -> bool:
        return self._stack is not None
