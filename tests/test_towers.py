"""The sharding check's embedding towers: the pinned towers on one host and on two hosts against the
unsharded collection, the tower defects torchrec has (each failing as the known issue says), the planted
tower bug (first shown to move torchrec's own outputs, then caught), and the cases' own validation."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings

from paritykit.checks.known_issues import load
from paritykit.checks.sharding.tower_cases import (
    dmp_case, idle_host_case, out_of_order_case, pinned_tower_cases, run_tower_case, tower_cases, tower_on_rank,
)
from paritykit.checks.sharding.tower_matrix import RULES
from paritykit.checks.sharding.tower_models import TowerCase, TowerShape, batch
from paritykit.errors import HarnessError, ParityError, RankFailure
from paritykit.harness import plants


# Each tower plant, and the test below that shows it caught.
TOWER_PLANTS = {"tower-features-not-permuted", "tower-interaction-not-synced"}


def test_every_tower_plant_has_a_test():
    from paritykit.checks.sharding import tower_plants

    assert {name for name, plant in plants.PLANTS.items() if plant.module == tower_plants.__name__} == TOWER_PLANTS


@pytest.mark.world_size(2)
def test_the_pinned_towers_on_one_host_train_like_the_unsharded_collection(rank_pool):
    (case, _) = pinned_tower_cases(1, 2)
    result = run_tower_case(case, rank_pool)
    # 4 towers (8 output columns) x 2 samples x 3 steps on each of 2 ranks, and all 6 tables.
    assert (result["output_elements"], result["tables"], result["ranks"]) == (96, 6, 2)


@pytest.mark.world_size(2)
def test_a_single_tower_sharded_by_its_own_sharder_trains_like_the_unsharded_tower(rank_pool):
    (_, case) = pinned_tower_cases(1, 2)
    assert case.single and case.towers[0].weighted and case.case_id().startswith("tower 1x2")
    # 3 output columns x 2 samples x 3 steps on each of 2 ranks.
    assert run_tower_case(case, rank_pool)["output_elements"] == 36


@pytest.mark.world_size(4, ranks_per_host=2)
def test_the_pinned_towers_on_two_hosts_train_like_the_unsharded_collection(rank_pool):
    (case,) = pinned_tower_cases(2, 2)
    assert {tower.host for tower in case.towers} == {0, 1}
    assert run_tower_case(case, rank_pool)["output_elements"] == 192


@pytest.mark.world_size(4, ranks_per_host=2)
def test_towers_placed_against_the_collections_order_come_back_in_host_order(rank_pool):
    with pytest.raises(ParityError, match=r"towers' columns in host order \(towers \[1, 0\]\)"):
        run_tower_case(out_of_order_case(2, 2), rank_pool)


def _all_reduce_over_a_new_group() -> float:
    import torch.distributed as dist

    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    one = torch.ones(1)
    dist.all_reduce(one, group=group)
    return one.item()


@pytest.mark.world_size(4, ranks_per_host=2)
def test_a_host_without_a_tower_puts_the_ranks_group_numbering_out_of_step_and_the_case_levels_it(rank_pool):
    with pytest.raises(ParityError, match=r"sharding created \[\d, \d, \d, \d\] process groups on ranks 0-3") as raised:
        run_tower_case(idle_host_case(2, 2), rank_pool)
    # Host 0's ranks one more than host 1's (the intra-host groups themselves are created once per process).
    first, second, third, fourth = (int(n) for n in re.search(r"\[(\d), (\d), (\d), (\d)\]", str(raised.value)).groups())
    assert first == second == third + 1 == fourth + 1
    # Brought level by the case: a group every rank creates next pairs up (it would hang otherwise).
    assert rank_pool.run(_all_reduce_over_a_new_group) == [4.0] * 4
    # The idle host's numbers are the unsharded module's (the gate's regular cases of it), alone or in a collection.
    for single in (False, True):
        assert run_tower_case(idle_host_case(2, 2, single), rank_pool, same_group_count=False)["output_elements"] == 16


@pytest.mark.world_size(2)
def test_distributed_model_parallel_cannot_shard_towers_on_cpu(rank_pool):
    with pytest.raises(RankFailure, match="DistributedDataParallel device_ids"):
        run_tower_case(dmp_case(2), rank_pool, via_dmp=True)


def test_every_tower_rule_has_a_known_issue():
    ids = {issue.id for issue in load() if issue.check == "sharding"}
    assert set(RULES) <= ids


@pytest.mark.world_size(4, ranks_per_host=2)
def test_the_unpermuted_features_plant_makes_torchrec_fail_and_is_reported(rank_pool):
    # The pinned case feeds its features in reverse order; on one host the sharded EBCs reorder them by
    # name themselves, across hosts they must be in the towers' order before they are split among hosts.
    (case,) = pinned_tower_cases(2, 2)
    rank_pool.call(tower_on_rank, (case,))
    with plants.applied(["tower-features-not-permuted"]):
        with pytest.raises(RankFailure, match="'f0_0' is not in list"):
            run_tower_case(case, rank_pool)


@pytest.mark.world_size(2)
def test_the_unsynced_interaction_plant_moves_torchrecs_outputs_and_is_caught(rank_pool):
    (case, _) = pinned_tower_cases(1, 2)
    clean = rank_pool.call(tower_on_rank, (case,))
    with plants.applied(["tower-interaction-not-synced"]):
        planted = rank_pool.call(tower_on_rank, (case,))
        assert torch.equal(clean[0]["outputs"][0], planted[0]["outputs"][0])  # the first step is before any update
        assert not torch.equal(clean[0]["outputs"][-1], planted[0]["outputs"][-1])
        with pytest.raises(ParityError, match="step 1: the sharded tower collection's outputs"):
            run_tower_case(case, rank_pool)


def test_a_tower_case_names_the_tower_at_fault():
    good = TowerShape((5,), 2, "table_row_wise", 0)
    with pytest.raises(HarnessError, match="tower 1: host 2 outside the case's 2 host"):
        TowerCase(2, 2, (good, TowerShape((5,), 2, "table_row_wise", 2)), 2, 1, (0, 1))
    with pytest.raises(HarnessError, match="tower 0: a table of 1 rows leaves one of the host's 2 ranks no rows"):
        TowerCase(1, 2, (TowerShape((1,), 2, "table_row_wise", 0),), 2, 1, (0,))
    with pytest.raises(HarnessError, match="tower 0: column ranks \\[3\\] outside the host's 2"):
        TowerCase(1, 2, (TowerShape((5,), 2, "table_column_wise", 0, (3,)),), 2, 1, (0,))
    with pytest.raises(HarnessError, match="key order \\[0, 0\\] is not a permutation of the 2 features"):
        TowerCase(1, 2, (TowerShape((5, 5), 2, "table_row_wise", 0),), 2, 1, (0, 0))


@settings(max_examples=25, deadline=None)
@given(tower_cases(3, 2))
def test_drawn_towers_sit_on_every_host_in_the_collections_order_and_feed_every_feature(case):
    assert case.hosts_in_order() and {tower.host for tower in case.towers} == {0, 1, 2}
    features, weighted = batch(case, 0, 0)
    keys = (features.keys() if features is not None else []) + (weighted.keys() if weighted is not None else [])
    assert sorted(keys) == sorted(f"f{t}_{i}" for t, i in case.features())
    assert all(len(jt.lengths()) == case.batch_size for kjt in (features, weighted) if kjt is not None
               for jt in kjt.to_dict().values())
