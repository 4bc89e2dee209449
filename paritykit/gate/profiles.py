"""Hypothesis profiles shared by this repo's suite and the gate.

dev: fast local iteration. ci: what CI runs on every change (2 cores, minutes).
release: thorough runs before a TorchRec/FBGEMM release ships.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "PARITYKIT_PROFILE"
DEFAULT_PROFILE = "dev"

# Examples per property. Multi-process parity examples cost tens of milliseconds to a second each,
# so the numbers are far below hypothesis' default of 100 except in release.
PROFILE_EXAMPLES = {"dev": 5, "ci": 8, "release": 100}


def register_profiles() -> None:
    # rank_pool is function-scoped only to read its marker; the pool itself lives for the session.
    suppressed = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
    common = dict(deadline=None, suppress_health_check=suppressed)
    for name, examples in PROFILE_EXAMPLES.items():
        settings.register_profile(name, max_examples=examples, **common)


def profile_from_env() -> str:
    name = os.environ.get(PROFILE_ENV, DEFAULT_PROFILE)
    if name not in PROFILE_EXAMPLES:
        raise ValueError(f"{PROFILE_ENV}={name!r} is not a profile; choose one of {sorted(PROFILE_EXAMPLES)}")
    return name


def load_profile_from_env() -> str:
    register_profiles()
    name = profile_from_env()
    settings.load_profile(name)
    return name
