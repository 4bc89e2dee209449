"""Planted bugs: small, realistic defects applied to the code under test for the self-test.

A plant is a named context manager that patches torchrec/fbgemm functions (or paritykit's own
conversion) for its duration; nothing installed is edited. Each check keeps its plants in its own
folder (``paritykit/checks/<check>/plants.py``) and registers them here with ``register``. A plant
active in the caller reaches every rank through ``paritykit.harness.call_context``: the call
carries the active plants' names and modules, and each rank applies them around the function.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

from paritykit.harness import call_context

Factory = Callable[[], ContextManager[Any]]


@dataclass(frozen=True)
class Plant:
    name: str
    check: str  # the check expected to catch it
    description: str
    factory: Factory
    module: str  # where it is registered, so a rank can import it


PLANTS: dict[str, Plant] = {}
_active: list[str] = []


def register(name: str, *, check: str, description: str = "") -> Callable[[Factory], Factory]:
    """Register a plant factory under ``name``, aimed at ``check``; the description defaults to its docstring."""

    def decorator(factory: Factory) -> Factory:
        if name in PLANTS:
            raise ValueError(f"plant {name!r} registered twice")
        doc = (factory.__doc__ or "").strip()
        PLANTS[name] = Plant(name, check, description or (doc.splitlines()[0] if doc else ""), factory, factory.__module__)
        return factory

    return decorator


def active() -> tuple[str, ...]:
    """Names of the plants applied in this process right now."""
    return tuple(_active)


@contextlib.contextmanager
def applied(names: tuple[str, ...] | list[str]) -> Iterator[None]:
    """Apply the named (registered) plants for the duration of the block, in this process."""
    unknown = [name for name in names if name not in PLANTS]
    if unknown:
        raise KeyError(f"unknown planted bug(s) {unknown}; known: {sorted(PLANTS)}")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(PLANTS[name].factory())
            _active.append(name)
            stack.callback(_active.remove, name)
        yield


@dataclass(frozen=True)
class CarriedPlants:
    """The plants active in the caller, as a call carries them: (name, registering module) pairs."""

    plants: tuple[tuple[str, str], ...]

    def __repr__(self) -> str:
        return f"plants {[name for name, _ in self.plants]}"


def applied_on_rank(carried: CarriedPlants) -> ContextManager[None]:
    """On a rank: import the plants' modules (which registers them), then apply them."""
    for _name, module in carried.plants:
        importlib.import_module(module)
    return applied([name for name, _module in carried.plants])


@call_context.register
def _carry_active_plants():
    if not _active:
        return None
    return applied_on_rank, CarriedPlants(tuple((name, PLANTS[name].module) for name in _active))
