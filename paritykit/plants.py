"""Planted bugs: small, realistic defects applied to the code under test for the self-test.

A plant is a named context manager that monkeypatches torchrec/fbgemm functions (or paritykit's
own conversion) for its duration. Nothing installed is edited. To reach rank workers, the parent
process's active plants travel with every RankPool.run call and each worker enters
``applied(names)`` around the function it runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

# name -> factory of a context manager that applies the defect. Filled by paritykit.selftest.
PLANTS: dict[str, Callable[[], ContextManager[None]]] = {}
# name -> (the check expected to catch it, a one-line description), for the self-test table.
PLANT_INFO: dict[str, tuple[str, str]] = {}

_active: list[str] = []


def register(
    name: str, *, check: str = "", description: str = ""
) -> Callable[[Callable[[], ContextManager[None]]], Callable[[], ContextManager[None]]]:
    def decorator(factory: Callable[[], ContextManager[None]]) -> Callable[[], ContextManager[None]]:
        if name in PLANTS:
            raise ValueError(f"plant {name!r} registered twice")
        PLANTS[name] = factory
        doc = (factory.__doc__ or "").strip()
        PLANT_INFO[name] = (check, description or (doc.splitlines()[0] if doc else ""))
        return factory

    return decorator


def catalog() -> dict[str, Callable[[], ContextManager[None]]]:
    """Every registered plant, after importing the catalog modules."""
    _load_catalog()
    return dict(PLANTS)


def active() -> tuple[str, ...]:
    """Names of the plants applied in this process right now (sent along with RankPool calls)."""
    return tuple(_active)


@contextlib.contextmanager
def applied(names: tuple[str, ...] | list[str]) -> Iterator[None]:
    """Apply the named plants for the duration of the block, in this process."""
    _load_catalog()
    unknown = [name for name in names if name not in PLANTS]
    if unknown:
        raise KeyError(f"unknown planted bug(s) {unknown}; known: {sorted(PLANTS)}")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(PLANTS[name]())
            _active.append(name)
            stack.callback(_active.remove, name)
        yield


@contextlib.contextmanager
def replaced(owner: object, name: str, make_replacement: Callable[[Any], Any]) -> Iterator[None]:
    """Set ``owner.name`` to ``make_replacement(original)`` for the block, then restore the original.

    The original is read from ``owner.__dict__`` where it is defined there, so that a method is
    restored as the function it was; an inherited attribute is removed again rather than copied down.
    """
    defined_here = name in vars(owner)
    original = vars(owner)[name] if defined_here else getattr(owner, name)
    setattr(owner, name, make_replacement(original))
    try:
        yield
    finally:
        if defined_here:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def _load_catalog() -> None:
    # The catalog registers itself on import; it imports torchrec, so only load it when needed.
    try:
        import paritykit.selftest.catalog  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name not in ("paritykit.selftest", "paritykit.selftest.catalog"):
            raise
