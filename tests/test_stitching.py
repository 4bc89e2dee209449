"""paritykit.stitching: shard-order math, and its agreement with torchrec's own permutation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paritykit.harness import plants
from paritykit.harness.plans import module_sharding_plan
from paritykit.harness.tables import TableSpec, build_ec
from paritykit.checks.sharding.stitching import (
    arrange_in_arrival_order,
    arrival_order,
    column_slices,
    cw_permute_indices,
    expected_feature_permute_indices,
    output_names,
    split_columns,
    stitch,
    torchrec_feature_permute_indices,
)


@st.composite
def shard_rank_placements(draw, max_world_size: int = 4, max_shards: int = 6) -> list[int]:
    """Arbitrary CW shard ranks: repeats and unsorted orders included."""
    world_size = draw(st.integers(1, max_world_size))
    return draw(st.lists(st.integers(0, world_size - 1), min_size=1, max_size=max_shards))


def test_seed_commit_example_shard_ranks_0_1_0_permute_to_0_2_1():
    # The commit that added CW sharding to EC: shard ranks [0, 1, 0] -> permute indices [0, 2, 1].
    assert arrival_order([0, 1, 0]) == [0, 2, 1]
    assert cw_permute_indices([0, 1, 0]) == [0, 2, 1]


def test_three_cycle_placement_is_not_its_own_inverse():
    # Arrival order for [1, 0, 0] is shards [1, 2, 0]; shard 0 arrives last.
    assert arrival_order([1, 0, 0]) == [1, 2, 0]
    assert cw_permute_indices([1, 0, 0]) == [2, 0, 1]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6).map(sorted))
def test_sorted_placements_need_no_permutation(ranks):
    assert cw_permute_indices(ranks) == list(range(len(ranks)))


@given(shard_rank_placements())
def test_permute_indices_are_a_permutation_consistent_with_arrival(ranks):
    permute = cw_permute_indices(ranks)
    assert sorted(permute) == list(range(len(ranks)))
    arrived = arrival_order(ranks)
    assert [arrived[p] for p in permute] == list(range(len(ranks)))


@given(shard_rank_placements(), st.sampled_from([1, 2, 4]), st.integers(0, 3), st.integers(0, 2**16))
def test_stitching_the_split_gives_the_tensor_back_for_every_rank_placement(ranks, width, rows, seed):
    full = torch.randn(rows, width * len(ranks), generator=torch.Generator().manual_seed(seed))
    arrived = arrange_in_arrival_order(split_columns(full, len(ranks)), ranks)
    assert torch.equal(stitch(arrived, ranks), full)


def test_concatenating_in_arrival_order_is_wrong_for_an_unsorted_placement():
    full = torch.arange(12.0).view(2, 6)
    arrived = arrange_in_arrival_order(split_columns(full, 3), [1, 0, 0])
    assert not torch.equal(torch.cat(arrived, dim=-1), full)
    assert torch.equal(stitch(arrived, [1, 0, 0]), full)


def test_bad_input_names_the_fault():
    with pytest.raises(ValueError, match="at least one shard"):
        cw_permute_indices([])
    with pytest.raises(ValueError, match="shard 1 has rank -2"):
        cw_permute_indices([0, -2])
    with pytest.raises(ValueError, match="cannot cut 10 columns into 3"):
        column_slices(10, 3)
    with pytest.raises(ValueError, match="2 arrived shard outputs for 3 shard ranks"):
        stitch([torch.zeros(1, 1)] * 2, [0, 1, 0])


def test_shared_features_get_feature_at_table_names():
    tables = (TableSpec("t0", 4, 8, ("a", "b")), TableSpec("t1", 4, 8, ("b",)))
    assert output_names(tables) == {("t0", "a"): "a", ("t0", "b"): "b@t0", ("t1", "b"): "b@t1"}


@st.composite
def ec_tables_and_plans(draw):
    world_size = draw(st.integers(2, 4))
    num_shards = draw(st.integers(2, 4))
    num_tables = draw(st.integers(1, 4))
    tables, plan = [], {}
    for i in range(num_tables):
        features = [f"f{i}"] + ([f"f{draw(st.integers(0, i - 1))}"] if i and draw(st.booleans()) else [])
        tables.append(TableSpec(f"t{i}", 5, 4 * num_shards, tuple(features)))
        kind = draw(st.sampled_from(["column_wise", "table_wise", "row_wise"])) if i else "column_wise"
        if kind == "column_wise":
            ranks = tuple(draw(st.lists(st.integers(0, world_size - 1), min_size=num_shards, max_size=num_shards)))
            plan[f"t{i}"] = ("column_wise", ranks)
        elif kind == "table_wise":
            plan[f"t{i}"] = ("table_wise", draw(st.integers(0, world_size - 1)))
        else:
            plan[f"t{i}"] = ("row_wise",)
    return tuple(tables), plan, world_size


def _torchrec_permutation(tables, plan, world_size):
    module = build_ec(tables, seed=0)
    module_plan = module_sharding_plan(module, plan, device="cpu", compute_kernel="fused", world_size=world_size)
    return torchrec_feature_permute_indices(module, module_plan)


@given(ec_tables_and_plans())
def test_permutation_agrees_with_torchrec_sharded_embedding_collection(drawn):
    tables, plan, world_size = drawn
    ours = expected_feature_permute_indices(tables, plan)
    assert ours  # at least one column-wise table, so the comparison is never empty
    assert _torchrec_permutation(tables, plan, world_size) == ours


def test_a_planted_inverted_permutation_disagrees_with_ours():
    tables = (TableSpec("t0", 5, 12, ("f0",)),)
    plan = {"t0": ("column_wise", (1, 0, 0))}
    with plants.applied(["cw-permute-inverted"]):
        theirs = _torchrec_permutation(tables, plan, 2)
    assert theirs == {"f0": [1, 2, 0]}
    assert expected_feature_permute_indices(tables, plan) == {"f0": [2, 0, 1]}
