"""Every check's planted bugs are registered for the tests that apply them by name; tests marked
``slow`` run only with ``--run-slow`` or ``PARITYKIT_PROFILE=release`` (they are deselected, and
pytest's summary counts them as such, never as passed)."""

import os

import pytest

from paritykit.checks import load_plants
from paritykit.gate.profiles import PROFILE_ENV

load_plants()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (the release profile does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow") or os.environ.get(PROFILE_ENV) == "release":
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
