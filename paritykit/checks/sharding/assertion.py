"""The sharding check's public assertion: the engine's ``assert_sharded_matches_unsharded`` for a
user's model, plus the built-in case form ``assert_sharded_matches_unsharded(case, pool)``."""

from __future__ import annotations

import functools
from typing import Any

from paritykit.checks.known_configurations import named_in_failures
from paritykit.checks.sharding.case_runner import run_sharding_case
from paritykit.checks.sharding.cases import ShardingCase
from paritykit.engine import assertion as engine_assertion


@functools.wraps(engine_assertion.assert_sharded_matches_unsharded)
def assert_sharded_matches_unsharded(model_fn: Any, plan: Any, batches: Any = None, **kwargs: Any) -> dict[str, Any]:
    # A failure names the known torchrec issues its configuration matches (known_configurations.py).
    with named_in_failures("sharding"):
        if isinstance(model_fn, ShardingCase):
            # The built-in case form: assert_sharded_matches_unsharded(case, pool).
            return run_sharding_case(model_fn, plan)
        return engine_assertion.assert_sharded_matches_unsharded(model_fn, plan, batches, **kwargs)
