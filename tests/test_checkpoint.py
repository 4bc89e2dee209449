"""The checkpoint check: what a reload must hold (the row-wise conversion, the resumed reference on
another world size), the setup's refusals, the rules and draws, and the round trips on the ranks."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from paritykit.checks.checkpoint.assertion import assert_checkpoint_roundtrip
from paritykit.checks.checkpoint.cases import CheckpointCase, case_setup, roundtrip_arguments
from paritykit.checks.checkpoint.draws import checkpoint_cases
from paritykit.checks.checkpoint.known_broken import RULES, broken_rules, holders, kept_out_rules
from paritykit.checks.checkpoint.matrix import ScaledExamples, placements_by_module, scaled
from paritykit.checks.checkpoint.pinned import cross_host_cases, known_broken_cases, steps
from paritykit.checks.runner import GateConfig, run_property
from paritykit.compare import find_differences
from paritykit.engine.checkpoint import CheckpointRecipe
from paritykit.engine.checkpoint_reference import column_blocks, expected_after_reload, reblocked, resumed_reference
from paritykit.engine.checkpoint_setup import build_checkpoint_setup
from paritykit.engine.reference import train_reference
from paritykit.errors import HarnessError
from paritykit.harness.hosts import host_layout
from paritykit.harness.tables import TableSpec, build_ebc

TABLES = (TableSpec("t0", 8, 8, ("f0",)), TableSpec("t1", 8, 8, ("f1",)))


def _setup(plan, reload_plan=None, *, world_size=2, save_after=1, count=2, reload_steps=None, **kwargs):
    batches = [[b for b in step] for step in _kjts(steps(world_size, count, keys=("f0", "f1")))]
    reload = None if reload_steps is None else _kjts(reload_steps)
    return build_checkpoint_setup(functools.partial(build_ebc, TABLES, seed=0), plan, batches, save_after=save_after,
                                  reload_plan=reload_plan, reload_batches=reload, **kwargs)


def _kjts(rank_steps):
    from paritykit.checks.checkpoint.cases import batches_of

    return batches_of(rank_steps)


# ---------------------------------------------------------------- the oracle, without ranks


def test_merging_column_blocks_gives_the_width_weighted_mean_of_their_accumulators():
    saved = torch.tensor([1.0, 2.0, 10.0, 20.0, 100.0, 200.0])  # 3 blocks of 2 rows, block after block
    assert torch.allclose(reblocked(saved, (4, 4, 4), (12,)), torch.tensor([37.0, 74.0]), rtol=1e-6, atol=0)  # thirds round
    assert torch.equal(reblocked(saved, (2, 2, 4), (4, 4)), torch.tensor([5.5, 11.0, 100.0, 200.0]))


def test_splitting_a_column_block_gives_each_part_the_blocks_value():
    assert torch.equal(reblocked(torch.tensor([3.0, 5.0]), (8,), (4, 4)), torch.tensor([3.0, 5.0, 3.0, 5.0]))


def test_a_partial_overlap_weighs_each_old_block_by_the_columns_it_shares():
    # New block [2, 6) covers 2 columns of old [0, 4) and 2 of old [4, 8): the mean of the two.
    out = reblocked(torch.tensor([1.0, 3.0]), (4, 4), (2, 4, 2))
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0]))


def test_only_row_wise_state_of_a_table_with_other_blocks_is_converted():
    saved = {"t0.weight/t0.momentum1": torch.arange(16.0), "t1.weight/t1.momentum1": torch.ones(8, 4),
             "t2.weight/t2.momentum1": torch.arange(8.0)}
    blocks_before = {"t0.weight": (4, 4), "t1.weight": (2, 2), "t2.weight": (8,)}
    blocks_after = {"t0.weight": (8,), "t1.weight": (4,), "t2.weight": (8,)}
    expected, converted = expected_after_reload(saved, blocks_before, blocks_after, {"t0.weight": 8, "t1.weight": 8, "t2.weight": 8})
    assert converted == {"t0.weight/t0.momentum1"}
    assert torch.equal(expected["t0.weight/t0.momentum1"], (torch.arange(8.0) + torch.arange(8.0, 16.0)) / 2)
    assert expected["t1.weight/t1.momentum1"] is saved["t1.weight/t1.momentum1"]


def test_the_resumed_reference_on_another_world_size_equals_two_chained_sgd_runs():
    # SGD keeps no state: training phase one, then phase two from its weights, is an independent oracle.
    setup = _setup({"t0": ("row_wise",), "t1": ("table_wise", 1)}, {"t0": ("table_wise", 0), "t1": ("row_wise",)},
                   count=2, save_after=2, reload_steps=steps(1, 2, offset=1, keys=("f0", "f1")))
    resumed = resumed_reference(setup.before, setup.after, 2, division=True)
    first = train_reference(dataclasses.replace(setup.before, batches=setup.before.batches[:2]))
    second = train_reference(dataclasses.replace(setup.after, full_state=first.state, sharding_plan=setup.before.sharding_plan))
    assert len(resumed.outputs) == 2 and len(resumed.outputs[0]) == 1
    assert not find_differences(resumed.state, second.state, rtol=1e-6, atol=1e-6)
    assert not find_differences(resumed.outputs, second.outputs, rtol=1e-6, atol=1e-6)
    assert find_differences(resumed.state, first.state, rtol=1e-6, atol=1e-6)  # phase two moved the tables


# ---------------------------------------------------------------- the setup's refusals


@pytest.mark.parametrize("save_after", [0, 3, True])
def test_a_save_point_outside_the_batches_is_a_harness_error(save_after):
    with pytest.raises(HarnessError, match="save_after must be a step count in"):
        _setup({"t0": ("row_wise",), "t1": ("table_wise", 1)}, save_after=save_after)


def test_a_save_after_the_last_batch_without_reload_batches_is_a_harness_error():
    with pytest.raises(HarnessError, match="nothing to train after the reload"):
        _setup({"t0": ("row_wise",), "t1": ("table_wise", 1)}, save_after=2)


def test_a_per_rank_checkpoint_onto_another_world_size_is_a_harness_error():
    with pytest.raises(HarnessError, match="per-rank checkpoint .* same world size"):
        _setup({"t0": ("row_wise",), "t1": ("table_wise", 1)}, {"t0": ("row_wise",), "t1": ("row_wise",)},
               reload_steps=steps(1, 1, keys=("f0", "f1")), recipe=CheckpointRecipe("per_rank"))


def test_a_reload_that_changes_how_a_table_trains_names_the_table():
    with pytest.raises(HarnessError, match="table 't1'.*data-parallel.*cannot carry over"):
        _setup({"t0": ("row_wise",), "t1": ("table_wise", 1)}, {"t0": ("row_wise",), "t1": ("data_parallel",)})


def test_the_resumed_model_starts_from_other_weights_than_the_saved_ones():
    setup = _setup({"t0": ("row_wise",), "t1": ("table_wise", 1)})
    for key, value in setup.before.full_state.items():
        assert value.shape == setup.after.full_state[key].shape and not torch.equal(value, setup.after.full_state[key])


# ---------------------------------------------------------------- rules and draws


def test_every_rule_has_one_known_broken_case_that_only_it_covers():
    cases = known_broken_cases(2)
    assert set(cases) == {rule.name for rule in RULES}
    for name, case in cases.items():
        assert [rule.name for rule in broken_rules(case)] == [name]


@pytest.mark.parametrize("entry, expected", [(("table_wise", 1), {1}), (("column_wise", (0, 2, 0)), {0, 2}),
                                             (("row_wise",), {0, 1, 2}), (("grid_shard", (0,)), {0, 1, 2}),
                                             (("data_parallel",), {0, 1, 2})])
def test_the_ranks_holding_a_table(entry, expected):
    assert holders(entry, 3) == expected


@pytest.mark.parametrize("entry, expected", [(("table_row_wise", 1), {2, 3}), (("grid_shard", (1,)), {2, 3}),
                                             (("grid_shard", (1, 0)), {0, 1, 2, 3}), (("table_column_wise", (3, 2)), {2, 3})])
def test_the_ranks_holding_a_table_placed_by_host_on_two_hosts(entry, expected):
    assert holders(entry, 4, ranks_per_host=2) == expected


def test_the_draws_avoid_every_kept_out_rule_and_agree_with_torchrecs_column_blocks():
    seen: list[CheckpointCase] = []
    run_property("checkpoint", checkpoint_cases((1, 2, 3), placements_by_module("cpu")), lambda case: seen.append(case) or {},
                 GateConfig(examples=120, seed=0, shrink=False), case_id=lambda case: case.case_id())
    assert all(broken_rules(case, kept_out_rules()) == [] for case in seen)
    assert {case.module for case in seen} == {"ec", "ebc"} and {c.recipe.method for c in seen} == {"dcp", "per_rank"}
    assert any(c.world_size != c.reload_world_size for c in seen) and any(c.plan != c.reload_plan for c in seen)
    kinds = {entry[0] for case in seen for plan in (case.plan, case.reload_plan) for entry in plan.values()}
    assert kinds >= {"table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "grid_shard", "data_parallel"}
    for case in seen[:40]:
        setup = case_setup(case)
        for which, side in (("plan", setup.before), ("reload_plan", setup.after)):
            counts = case.block_counts(which)
            assert {fqn.split(".")[-2]: len(b) for fqn, b in column_blocks(side).items()} == counts


def test_the_draws_on_two_hosts_place_by_host_and_cut_grids_as_torchrec_does():
    hosts = host_layout(4, 2)
    seen: list[CheckpointCase] = []
    run_property("checkpoint", checkpoint_cases((4,), placements_by_module("cpu"), hosts=hosts), lambda case: seen.append(case) or {},
                 GateConfig(examples=80, seed=0, shrink=False), case_id=lambda case: case.case_id())
    assert seen and all(c.ranks_per_host == 2 and c.world_size == c.reload_world_size == 4 and c.module == "ebc" for c in seen)
    assert all(broken_rules(case, kept_out_rules()) == [] for case in seen)
    grids = [e[1] for c in seen for plan in (c.plan, c.reload_plan) for e in plan.values() if e[0] == "grid_shard"]
    assert any(len(blocks) == 2 for blocks in grids) and {1} <= {h for blocks in grids for h in blocks}
    assert any(e == ("table_row_wise", 1) for c in seen for e in c.plan.values())
    twcw = [e[1] for c in seen for e in c.plan.values() if e[0] == "table_column_wise"]
    assert twcw and all(len({r // 2 for r in ranks}) == 1 for ranks in twcw)  # one host's ranks
    for case in seen[:30]:
        setup = case_setup(case)
        assert setup.ranks_per_host == 2
        for which, side in (("plan", setup.before), ("reload_plan", setup.after)):
            assert {fqn.split(".")[-2]: len(b) for fqn, b in column_blocks(side).items()} == case.block_counts(which)


def test_a_round_trip_resolved_for_two_hosts_refuses_a_one_host_pool_before_any_rank_runs():
    class StandInPool:  # what the check reads of a pool; no rank is started
        world_size, ranks_per_host, device = 4, 4, "cpu"

        def call(self, *args, **kwargs):
            raise AssertionError("no rank may run")

    case = cross_host_cases(host_layout(4, 2))[0]
    (model, plan, batches), kwargs = roundtrip_arguments(case)
    with pytest.raises(HarnessError, match="2 hosts x 2 ranks.*one host of 4 ranks"):
        assert_checkpoint_roundtrip(model, plan, batches, **kwargs, pool_for=lambda world_size: StandInPool())


def test_the_drawn_round_trips_replay_with_the_examples_asked_for():
    config = scaled(GateConfig(examples=50, seed=3))
    assert isinstance(config, ScaledExamples) and config.examples == 12
    assert "--examples 50 " in config.replay("checkpoint", "some case")
