"""torchrec's pooled reduce-scatters and all-gather on their own, forward and backward, asynchronous and
synchronous, with gradient division on and off, against the hand computation of what they mean."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.sharding.collective_cases import (CollectiveCase, collective_cases, expected_collectives, rows_per_rank,
                                                        run_collective_case, subgroup_collective_cases)
from paritykit.errors import HarnessError


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", collective_cases(2), ids=lambda c: f"sync={c.sync}-division={c.division}")
def test_each_collective_means_what_it_says_on_two_ranks(rank_pool, case):
    assert run_collective_case(case, rank_pool)["operations"] == (4 if case.sync else 3)


@pytest.mark.world_size(3)
def test_the_collectives_mean_what_they_say_on_three_ranks(rank_pool):
    assert [run_collective_case(case, rank_pool)["ranks"] for case in collective_cases(3)] == [3] * 4


def test_on_subgroups_each_group_is_its_own_world():
    on_groups, alone = expected_collectives(subgroup_collective_cases(4)[0]), expected_collectives(CollectiveCase(2, False, True))
    # (They run on the pool of two hosts: tests/test_dmp_reshard.py.) Group {1, 3} sees what a world of two ranks sees, its members' inputs in the place of ranks 0 and 1.
    output, grad = on_groups[3]["all_gather_base_pooled"]
    assert output.shape == alone[1]["all_gather_base_pooled"][0].shape == (4, 4)
    assert not torch.equal(output, alone[1]["all_gather_base_pooled"][0])
    assert subgroup_collective_cases(2) == () and subgroup_collective_cases(4)[0].group_of(2) == (0, 2)


def test_the_hand_computation_sums_chunks_and_divides_gradients_only_with_division():
    on, off = expected_collectives(CollectiveCase(2, True, True)), expected_collectives(CollectiveCase(2, True, False))
    output, grad = on[1]["reduce_scatter_v_pooled"]
    assert output.shape == (rows_per_rank(2)[1], 4) and grad.shape == (sum(rows_per_rank(2)), 4)
    assert torch.equal(off[1]["reduce_scatter_v_pooled"][1], 2 * grad)
    gathered, gathered_grad = on[0]["all_gather_base_pooled"]
    assert gathered.shape == (4, 4) and torch.equal(off[0]["all_gather_base_pooled"][1], 2 * gathered_grad)


def test_the_asynchronous_reduce_scatter_v_of_uneven_splits_is_left_to_its_known_issue():
    assert "reduce_scatter_v_pooled" not in CollectiveCase(2, sync=False, division=True).operations()


@pytest.mark.world_size(2)
def test_a_collectives_case_on_a_pool_of_another_size_is_a_harness_error(rank_pool):
    with pytest.raises(HarnessError, match="world size 3"):
        run_collective_case(CollectiveCase(3, True, True), rank_pool)
