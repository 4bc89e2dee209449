"""The modules check's gate entry: every dense module family (pinned specs, then drawn ones) against
its formula, the managed-collision remapper against its eviction policy, MC-EC/EBC against the remap
plus a hand lookup, an MC-EBC sharded row-wise on the ranks (mc_sharded_cases.py), the object pools
unsharded and sharded row-wise against a pool model (pool_cases.py), the position-weighted feature
processors against their weights by hand (position_cases.py), the embedding configs and the
modules' construction against what they mean (config_cases.py), and the known-broken
reproductions. All on CPU; only the sharded modules need a pool."""

from __future__ import annotations

from typing import Any

from paritykit.checks.modules.config_cases import CONFIG_CASES
from paritykit.checks.modules.dense_cases import run_dense_case
from paritykit.checks.modules.draws import PINNED, strategies
from paritykit.checks.modules.known_broken import KNOWN_BROKEN, SHARDED_KNOWN_BROKEN
from paritykit.checks.modules.mc_lookup_cases import mc_properties
from paritykit.checks.modules.mc_sharded_cases import pinned_specs, run_sharded_mc_case, sharded_mc_specs
from paritykit.checks.modules.pool_cases import pinned_pool_specs, pool_specs, run_pool_case, too_long_sample_is_refused
from paritykit.checks.modules.position_cases import PINNED as POSITION_PINNED
from paritykit.checks.modules.position_cases import position_specs, run_position_case
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property

NAME = "modules"
CPU_ONLY = "the modules check builds its modules on CPU in this version (the dense formulas are device-independent)"


def run_matrix(config: GateConfig, pools: Any = None) -> list[CaseResult]:
    if config.device != "cpu":
        return [CaseResult(NAME, "modules", "skip", replay=config.replay(NAME), message=CPU_ONLY)]
    results: list[CaseResult] = []
    for family, strategy in strategies().items():
        results += run_property(NAME, strategy, run_dense_case, config, case_id=lambda spec: spec.case_id(),
                                explicit=PINNED[family])
    for strategy, body, pinned in mc_properties():
        results += run_property(NAME, strategy, body, config, case_id=lambda spec: spec.case_id(), explicit=pinned)
    # The object pools in the caller, against the pool model.
    for kind in ("tensor", "kjt"):
        results += run_property(NAME, pool_specs(kind, 1), lambda spec: run_pool_case(None, spec), config,
                                case_id=lambda spec: spec.case_id(), explicit=pinned_pool_specs(kind, 1))
    results += run_property(NAME, position_specs(), run_position_case, config, case_id=lambda spec: spec.case_id(),
                            explicit=POSITION_PINNED)
    for what, body in CONFIG_CASES:
        results.append(run_case(NAME, what, config, body))
    for max_length, length in ((1, 2), (3, 5)):
        results.append(run_case(NAME, f"kjt-pool unsharded refuses a sample of {length} values for a feature of max length {max_length}",
                                config, lambda max_length=max_length, length=length: too_long_sample_is_refused(max_length, length)))
    # The sharded modules here: an MC-EBC sharded row-wise, each shard's remapper against the model; the
    # object pools sharded row-wise, against the pool model fed every rank's updates.
    for world_size in (w for w in config.world_sizes if w > 1 and pools is not None):
        pool = pools.get(world_size)
        results += run_property(NAME, sharded_mc_specs(world_size), lambda spec, pool=pool: run_sharded_mc_case(pool, spec),
                                config, case_id=lambda spec: spec.case_id(), explicit=pinned_specs(world_size))
        for kind in ("tensor", "kjt"):
            results += run_property(NAME, pool_specs(kind, world_size), lambda spec, pool=pool: run_pool_case(pool, spec),
                                    config, case_id=lambda spec: spec.case_id(), explicit=pinned_pool_specs(kind, world_size))
        if world_size == 2:
            for rule, (what, body) in SHARDED_KNOWN_BROKEN.items():
                results.append(run_case(NAME, f"known-broken {rule}: {what}", config, lambda body=body, pool=pool: body(pool)))
    for rule, (what, body) in KNOWN_BROKEN.items():
        results.append(run_case(NAME, f"known-broken {rule}: {what}", config, body))
    return results
