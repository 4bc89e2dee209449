"""The sharding check's gate entry: at every world size, the pinned cases, the drawn matrix, and the
combinations known to fail inside torchrec, each compared with the unsharded module trained alike."""

from __future__ import annotations

from collections import Counter

from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_known_broken_case, run_property
from paritykit.checks.sharding.case_runner import run_sharding_case
from paritykit.checks.sharding.dmp_matrix import run_dmp_matrix
from paritykit.checks.sharding.fp_cases import fp_cases, run_fp_case
from paritykit.checks.sharding.fp_known_broken import known_broken_fp_cases
from paritykit.checks.sharding.draws import EBC_PLACEMENTS, EC_PLACEMENTS, sharding_cases
from paritykit.checks.sharding.known_broken import MIN_WORLD_SIZE, RULES, known_broken_cases
from paritykit.checks.sharding.optimizer_draws import optimizer_pinned_cases
from paritykit.checks.sharding.plan_matrix import run_plan_matrix
from paritykit.checks.sharding.pinned import pinned_cases
from paritykit.checks.sharding.tower_matrix import run_tower_matrix
from paritykit.dist import PoolProvider
from paritykit.errors import HarnessError
from paritykit.harness.hosts import HostLayout, host_layout
from paritykit.harness.plans import column_widths_supported, implemented_placements, local_world_size

NAME = "sharding"


def examples_per_plan_shape(results: list[CaseResult]) -> Counter:
    """How many examples passed per plan shape (so a run cannot pass on nothing)."""
    return Counter(r.metrics.get("plan_shape", "?") for r in results if r.status == "pass")


def placements_by_module(device: str) -> dict[str, tuple[str, ...]]:
    """The placements drawn per module: those torchrec's sharder implements, and column-wise shards of
    unequal widths wherever column-wise is and torchrec's helper takes the widths."""
    def drawn(module: str, kinds: tuple[str, ...]) -> tuple[str, ...]:
        implemented = implemented_placements(module, device)
        sized = "column_wise" in implemented and column_widths_supported()
        return tuple(k for k in kinds if k in implemented or (k == "column_wise_sized" and sized))

    return {"ebc": drawn("ebc", EBC_PLACEMENTS), "ec": drawn("ec", EC_PLACEMENTS)}


def host_layouts(config: GateConfig) -> list[HostLayout]:
    """Each world size as the hosts its pool stands for (one host; under torchrun the launch's), then
    the config's layouts of several hosts."""
    layouts = [host_layout(w, local_world_size(w)) for w in config.world_sizes] + list(config.hosts)
    return list(dict.fromkeys(layouts))


def run_matrix(config: GateConfig, pools: PoolProvider) -> list[CaseResult]:
    results: list[CaseResult] = []
    known_broken: list[CaseResult] = []
    kinds = placements_by_module(config.device)
    for hosts in host_layouts(config):
        ranks_per_host = hosts.ranks_per_host if hosts.hosts > 1 else None
        pool = pools.get(hosts.world_size, ranks_per_host=ranks_per_host)
        results += run_property(
            NAME,
            sharding_cases(hosts.world_size, kinds, ranks_per_host=ranks_per_host),
            lambda case, pool=pool: run_sharding_case(case, pool),
            config,
            case_id=lambda case: case.case_id(),
            # The optimizer cases are about fbgemm's rules, not placements: one host is enough.
            explicit=pinned_cases(hosts.world_size, ranks_per_host) + (optimizer_pinned_cases(hosts.world_size) if hosts.hosts == 1 else ()),
        )
    # The pinned cross-host cases on a layout the config does not draw on (3x2 beside a square 2x2).
    for hosts in (h for h in config.pinned_host_layouts() if h not in config.hosts):
        pool = pools.get(hosts.world_size, ranks_per_host=hosts.ranks_per_host)
        results += [run_case(NAME, case.case_id(), config, lambda case=case, pool=pool: run_sharding_case(case, pool))
                    for case in pinned_cases(hosts.world_size, hosts.ranks_per_host)]
    # DistributedModelParallel's options and torchrec's collectives under the same oracle (dmp_cases.py),
    # before the known-broken cases below, whose failures may cost a pool rebuild.
    dmp_results, dmp_known_broken = run_dmp_matrix(NAME, config, pools)
    # torchrec's plan helpers against paritykit's shard layout; configured init bounds on the shards (plan_matrix.py).
    results += run_plan_matrix(NAME, config, pools)
    results += dmp_results
    known_broken += dmp_known_broken
    # Feature-processed EBCs sharded by DMP (fp_cases.py), both forms of position weights, on one host.
    for world_size in config.world_sizes:
        pool = pools.get(world_size)
        results += [run_case(NAME, case.case_id(), config, lambda case=case, pool=pool: run_fp_case(case, pool))
                    for case in fp_cases(world_size, config.seed)]
    # Embedding tower collections sharded by torchrec's tower sharder, on every layout (tower_matrix.py).
    tower_results, tower_known_broken = run_tower_matrix(NAME, config, pools, host_layouts(config))
    results += tower_results
    known_broken += tower_known_broken
    fp_sizes = [w for w in config.world_sizes if w >= 2]  # one rank has no replicas to drift apart
    for case_id, body in (known_broken_fp_cases(min(fp_sizes)).values() if fp_sizes else ()):
        pool = pools.get(min(fp_sizes))
        known_broken.append(run_known_broken_case(NAME, case_id, config, pool, lambda body=body, pool=pool: body(pool)))
    # Each broken combination fails the same way at every world size; run it once, on the smallest
    # that shows it (a failure on two ranks may leave a peer waiting in a collective: a pool rebuild).
    for rule in RULES:
        sizes = [w for w in config.world_sizes if w >= MIN_WORLD_SIZE.get(rule.name, 1)]
        if not sizes:
            continue
        pool, case = pools.get(min(sizes)), known_broken_cases(min(sizes))[rule.name]
        # Every outcome is reported as it is; the gate matches failures against the known issues.
        known_broken.append(run_known_broken_case(NAME, f"known-broken {rule.name} {case.case_id()}", config, pool,
                                                  lambda case=case, pool=pool: run_sharding_case(case, pool)))
    if not examples_per_plan_shape(results) and not any(r.status == "fail" for r in results):
        results.append(CaseResult(NAME, "<no examples>", "error", replay=config.replay(NAME),
                                  message=str(HarnessError("no sharding example ran: every draw was rejected or unsupported"))))
    return results + known_broken
