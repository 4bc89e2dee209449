"""The sharding check on ranks standing for several hosts: plans resolved for the pool's hosts, the
cross-host draws and pinned cases against the unsharded module, and the planted cross-host bugs,
which move torchrec's numbers on 2 hosts x 2 ranks, pass unnoticed on one host, and are caught."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.runner import DEFAULT_HOSTS, GateConfig, run_property
from paritykit.checks.sharding.case_runner import run_sharding_case
from paritykit.checks.sharding.cases import ShardingCase
from paritykit.checks.sharding.draws import BY_HOST, sharding_cases
from paritykit.checks.sharding.known_broken import broken_rules, kept_out_rules
from paritykit.checks.sharding.matrix import host_layouts, placements_by_module
from paritykit.checks.sharding.pinned import pinned_cases
from paritykit.errors import HarnessError, ParityError
from paritykit.harness import plants
from paritykit.harness.hosts import HostLayout
from paritykit.harness.plan_resolution import resolve_plan
from paritykit.harness.tables import TableSpec, build_ebc
from test_sharding_plants import moved, sharded_run

# Each cross-host plant and the pinned 2x2 case that shows it (cross_host_cases' order).
CROSS_HOST_PLANT_CASES = {
    "twrw-input-dist-not-staggered": 0,  # TWRW on both hosts
    "grid-blocks-in-host-order": 1,  # GRID with host indexes (1, 0)
}

# The plants that only a layout of another host count than ranks per host shows (3x2, not 2x2).
NON_SQUARE_HOST_PLANTS = {"twrw-input-staggered-by-ranks-per-host"}


def two_by_two(index: int) -> ShardingCase:
    return pinned_cases(4, 2)[index]


def ebc_tables():
    return build_ebc((TableSpec("t0", 8, 8, ("f0",)), TableSpec("t1", 8, 256, ("f1",))), seed=0)


def test_a_plan_is_resolved_for_the_hosts_of_the_ranks_not_the_callers_environment():
    from torchrec.distributed.sharding_plan import grid_shard, table_row_wise

    plan = {"t0": table_row_wise(host_index=1), "t1": grid_shard(host_indexes=[1, 0])}
    resolved = resolve_plan(ebc_tables(), plan, world_size=4, device_type="cpu", local_size=2).plan[""]
    assert resolved["t0"].ranks == [2, 3]  # the second host's ranks
    assert resolved["t1"].ranks == [2, 3, 0, 1]  # column block 0 on host 1, block 1 on host 0
    assert [list(s.shard_offsets) for s in resolved["t1"].sharding_spec.shards] == [[0, 0], [4, 0], [0, 128], [4, 128]]
    # The same plan resolved for one host of 4 (this process is no launch): host 1 does not exist.
    with pytest.raises(HarnessError, match="table 't0'.*outside world size 4"):
        resolve_plan(ebc_tables(), plan, world_size=4, device_type="cpu")
    with pytest.raises(HarnessError, match="ranks_per_host=3 does not divide world size 4"):
        resolve_plan(ebc_tables(), plan, world_size=4, device_type="cpu", local_size=3)


def test_table_row_wise_shards_across_hosts_are_a_harness_error_naming_the_table():
    import dataclasses

    from torchrec.distributed.sharding_plan import grid_shard, table_row_wise

    model = ebc_tables()
    resolved = resolve_plan(model, {"t0": table_row_wise(host_index=0), "t1": grid_shard(host_indexes=[0, 0])},
                            world_size=4, device_type="cpu", local_size=4).plan[""]
    # Resolved for one host of 4, given to ranks standing for 2 hosts of 2: rows 0-3 of t0 span both.
    with pytest.raises(HarnessError, match=r"table 't0': table_row_wise shards on ranks \[0, 1, 2, 3\], but on 2 hosts x 2"):
        resolve_plan(model, {"t0": resolved["t0"], "t1": resolved["t1"]}, world_size=4, device_type="cpu", local_size=2)
    swapped = dataclasses.replace(resolved["t0"], ranks=[1, 0, 2, 3])
    with pytest.raises(HarnessError, match="one host's ranks in order"):
        resolve_plan(model, {"t0": swapped, "t1": resolved["t1"]}, world_size=4, device_type="cpu", local_size=4)


@pytest.mark.world_size(4, ranks_per_host=2)
def test_users_plans_through_the_public_assertion_use_the_pools_hosts(rank_pool):
    import paritykit
    from torchrec.distributed.sharding_plan import column_wise, grid_shard, table_row_wise
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def batch(rank: int):
        return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([rank, 7 - rank, 1, 2, 3]),
                                                   torch.tensor([1, 1, 2, 1]))

    plan = {"t0": table_row_wise(host_index=1), "t1": grid_shard(host_indexes=[1, 0])}
    metrics = paritykit.assert_sharded_matches_unsharded(ebc_tables, plan, [[batch(r) for r in range(4)]] * 2, pool=rank_pool)
    assert metrics["steps"] == 2 and metrics["ranks"] == 4
    plan["t0"] = column_wise(ranks=[3, 0])
    assert paritykit.assert_sharded_matches_unsharded(ebc_tables, plan, [[batch(r) for r in range(4)]], pool=rank_pool)["ranks"] == 4


@pytest.mark.world_size(4, ranks_per_host=2)
@pytest.mark.parametrize("index", range(len(pinned_cases(4, 2))))
def test_every_cross_host_pinned_case_trains_like_the_unsharded_module(rank_pool, index):
    metrics = run_sharding_case(pinned_cases(4, 2)[index], rank_pool)
    assert metrics["steps"] == 3 and metrics["ranks"] == 4 and "hosts=2x2" in metrics["plan_shape"]


def test_a_case_for_two_hosts_is_refused_by_a_one_host_pool():
    from types import SimpleNamespace

    one_host = SimpleNamespace(world_size=4, ranks_per_host=4, device="cpu")
    with pytest.raises(HarnessError, match="case needs 2 hosts x 2 ranks, the pool stands for 1 host"):
        run_sharding_case(two_by_two(0), one_host)


def test_the_cross_host_draws_place_by_host_in_every_way():
    # Drawn the way the gate draws them, over a few seeds (one seed's examples are correlated).
    seen: list[ShardingCase] = []
    for seed in range(3):
        run_property("sharding", sharding_cases(6, placements_by_module("cpu"), ranks_per_host=2),
                     lambda case: seen.append(case) or {}, GateConfig(examples=70, seed=seed, shrink=False),
                     case_id=lambda c: c.case_id())
    hosts = HostLayout(3, 2)
    assert all(case.module == "ebc" and case.hosts == hosts for case in seen)
    assert all(any(e[0] in BY_HOST for e in case.plan.values()) for case in seen)
    assert all(broken_rules(case, kept_out_rules()) == [] for case in seen)
    entries = [entry for case in seen for entry in case.plan.values()]
    assert {e[1] for e in entries if e[0] == "table_row_wise"} == {0, 1, 2}
    grids = [e[1] for e in entries if e[0] == "grid_shard"]
    assert any(list(h) != sorted(h) for h in grids) and any(len(set(h)) < len(h) for h in grids)
    twcw_hosts = {hosts.host_of(e[1][0]) for e in entries if e[0] == "table_column_wise"}
    assert twcw_hosts == {0, 1, 2}
    assert all(len({hosts.host_of(r) for r in e[1]}) == 1 for e in entries if e[0] == "table_column_wise")
    assert any(len({hosts.host_of(r) for r in e[1]}) > 1 for e in entries if e[0] == "column_wise")
    assert {e[0] for e in entries} >= {"table_wise", "row_wise", "data_parallel"}
    grid_dims = {t.embedding_dim for case in seen for t in case.tables if case.plan[t.name][0] == "grid_shard"
                 and len(case.plan[t.name][1]) > 1}
    assert grid_dims and all(dim % 128 == 0 for dim in grid_dims)


def test_the_gate_runs_the_default_hosts_beside_one_host_world_sizes():
    config = GateConfig(world_sizes=(1, 2), hosts=DEFAULT_HOSTS)
    assert host_layouts(config) == [HostLayout(1, 1), HostLayout(1, 2), HostLayout(2, 2)]
    assert "--world-size 1,2 --hosts 2x2 " in config.replay("sharding")
    assert "--hosts none " in GateConfig(world_sizes=(2,)).replay("sharding")


def test_every_cross_host_plant_has_a_case():
    registered = {name for name, plant in plants.PLANTS.items() if plant.check == "sharding"}
    assert set(CROSS_HOST_PLANT_CASES) <= registered


@pytest.mark.parametrize("plant", sorted(CROSS_HOST_PLANT_CASES))
def test_a_cross_host_plant_moves_torchrecs_numbers_on_two_hosts_and_is_caught(rank_pools, plant):
    pool, case = rank_pools.get(4, ranks_per_host=2), two_by_two(CROSS_HOST_PLANT_CASES[plant])
    clean = sharded_run(pool, case)
    with plants.applied([plant]):
        assert moved(clean, sharded_run(pool, case)), f"{plant} leaves the sharded numbers unchanged on 2 hosts"
        with pytest.raises(ParityError, match="differs from the unsharded reference"):
            run_sharding_case(case, pool)
    assert run_sharding_case(case, pool)["steps"] == 3


def test_a_stagger_by_ranks_per_host_passes_on_two_by_two_and_is_caught_on_three_by_two(rank_pools):
    # The square layout cannot tell the host count from the ranks per host; the gate's pinned cases
    # also run on 3x2 (GateConfig.pinned_host_layouts) for that.
    (plant,) = NON_SQUARE_HOST_PLANTS
    with plants.applied([plant]):
        assert run_sharding_case(two_by_two(0), rank_pools.get(4, ranks_per_host=2))["steps"] == 3
        with pytest.raises(ParityError, match="differs from the unsharded reference"):
            run_sharding_case(pinned_cases(6, 2)[0], rank_pools.get(6, ranks_per_host=2))
    assert run_sharding_case(pinned_cases(6, 2)[0], rank_pools.get(6, ranks_per_host=2))["steps"] == 3


def pinned_and_drawn(pool, world_size: int, ranks_per_host: int | None) -> list:
    """The sharding check's pinned and drawn cases on ``pool``, as its gate entry runs them (3 examples)."""
    return run_property("sharding", sharding_cases(world_size, placements_by_module("cpu"), ranks_per_host=ranks_per_host),
                        lambda case: run_sharding_case(case, pool), GateConfig(examples=3, seed=0, shrink=False),
                        case_id=lambda case: case.case_id(), explicit=pinned_cases(world_size, ranks_per_host))


@pytest.mark.parametrize("plant", sorted(CROSS_HOST_PLANT_CASES))
def test_a_cross_host_plant_passes_unnoticed_on_one_host_of_four_and_is_caught_on_two_hosts_of_two(rank_pools, plant):
    # The blind spot this closes: on one host the check's cases stay green, at the same world size.
    with plants.applied([plant]):
        one_host = pinned_and_drawn(rank_pools.get(4), 4, None)
        two_hosts = pinned_and_drawn(rank_pools.get(4, ranks_per_host=2), 4, 2)
    assert len(one_host) >= len(pinned_cases(4)) and {r.status for r in one_host} == {"pass"}
    caught = [r for r in two_hosts if r.status == "fail"]
    assert caught and all("hosts=2x2" in r.case_id for r in caught), [r.case_id for r in two_hosts]


def test_under_a_launch_of_two_hosts_td_kjt_draws_table_row_wise_on_either_host(monkeypatch):
    from paritykit.checks.td_kjt.sharded_draw import sharded_cases as td_kjt_cases

    def twrw_hosts() -> set[int]:
        seen: list = []
        run_property("td-kjt", td_kjt_cases(4, "cpu", module="ebc", variable_batch=False), lambda case: seen.append(case) or {},
                     GateConfig(examples=60, seed=0, shrink=False), case_id=lambda case: case.describe())
        return {entry[1] for case in seen for entry in case.plan.values() if entry[0] == "table_row_wise"}

    assert twrw_hosts() == {0}  # one host: every rank is local
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert twrw_hosts() == {0, 1}
