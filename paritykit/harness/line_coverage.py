"""coverage.py in the caller and in every rank, with one dynamic context per case.

``paritykit coverage`` starts coverage.py in its own process and sets ``RANK_CONFIG_ENV`` to the
coverage configuration file; a rank started while it is set measures itself too (``start_in_rank``,
called by the rank's worker before it imports torchrec), writing its own data file next to the
caller's. The case running in the caller (``paritykit.harness.case_scope``) travels with every call
to the ranks as a carried context (``paritykit.harness.call_context``), so a torchrec line run on a
rank is recorded under the case that made the call. Everything here is a no-op unless coverage was
asked for.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from paritykit.harness import call_context, case_scope

RANK_CONFIG_ENV = "PARITYKIT_COVERAGE_RCFILE"
# Lines run between cases (pool start-up, imports) are recorded under this context.
IDLE_CONTEXT = "(between cases)"

_active: Any = None  # the coverage.Coverage measuring this process, if any


def start(config_file: str, data_file: str) -> Any:
    """Measure this process (the caller) and let the ranks started from now on measure themselves."""
    global _active
    import coverage

    _active = coverage.Coverage(config_file=config_file, data_file=data_file, data_suffix=True)
    _active.start()
    _active.switch_context(IDLE_CONTEXT)
    os.environ[RANK_CONFIG_ENV] = config_file
    os.environ["PARITYKIT_COVERAGE_DATA_FILE"] = data_file
    case_scope.add_listener(_switch)
    call_context.register(_capture)
    return _active


def stop() -> None:
    """Stop measuring this process and save its data; ranks started afterwards do not measure."""
    global _active
    case_scope.remove_listener(_switch)
    os.environ.pop(RANK_CONFIG_ENV, None)
    os.environ.pop("PARITYKIT_COVERAGE_DATA_FILE", None)
    if _active is not None:
        _active.stop()
        _active.save()
        _active = None


def start_in_rank() -> None:
    """In a rank's worker, before torchrec is imported: measure this rank if the caller asked."""
    global _active
    config_file = os.environ.get(RANK_CONFIG_ENV)
    if not config_file or _active is not None:
        return
    import coverage

    _active = coverage.Coverage(config_file=config_file, data_file=os.environ["PARITYKIT_COVERAGE_DATA_FILE"],
                                data_suffix=True)
    _active.start()
    _active.switch_context(IDLE_CONTEXT)


def save_in_rank() -> None:
    """Write what this rank measured so far: a rank torn down later (a failed call) loses nothing."""
    if _active is not None:
        _active.save()


def _switch(label: str | None) -> None:
    if _active is not None:
        _active.switch_context(label or IDLE_CONTEXT)


def _capture() -> "tuple[Any, str] | None":
    if _active is None or case_scope.current() is None:
        return None
    return (in_case, case_scope.current())


@contextlib.contextmanager
def in_case(label: str) -> Iterator[None]:
    """On a rank: record the lines of this call under the caller's case."""
    _switch(label)
    try:
        yield
    finally:
        _switch(None)
        save_in_rank()
