"""paritykit: correctness and numerical-parity checks for TorchRec.

The public API, re-exported lazily so that `import paritykit` (and the pytest plugin) does not
pay for importing torchrec until a function that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ParityError": "paritykit.errors",
    "HarnessError": "paritykit.errors",
    "RankFailure": "paritykit.errors",
    "UnsupportedByTorchrec": "paritykit.errors",
    "assert_close": "paritykit.compare",
    "td_to_kjt": "paritykit.convert",
    "kjt_to_td": "paritykit.convert",
    "assert_td_kjt_parity": "paritykit.checks.td_kjt.assertion",
    "cw_permute_indices": "paritykit.checks.sharding.stitching",
    "assert_sharded_matches_unsharded": "paritykit.checks.sharding.assertion",
    "assert_pipeline_parity": "paritykit.checks.pipeline.assertion",
    "assert_checkpoint_roundtrip": "paritykit.checks.checkpoint.assertion",
    "OptimizerSpec": "paritykit.harness.optimizers",
    "Tolerance": "paritykit.engine.comparison",
    "Bound": "paritykit.engine.comparison",
    "resolve_plan": "paritykit.harness.plan_resolution",
    "shard_model": "paritykit.harness.dmp",
    "load_full_state": "paritykit.harness.dmp",
    "gather_full_state": "paritykit.harness.dmp",
    "sync_guard": "paritykit.sync",
    "count_syncs": "paritykit.sync",
    "on_host": "paritykit.sync",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paritykit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
