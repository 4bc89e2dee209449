"""The sharding check: built-in cases through the one engine, the combinations known to fail inside
torchrec, the draws, and the gate entry."""

from __future__ import annotations

import dataclasses

import pytest

from paritykit.checks.runner import GateConfig
from paritykit.checks.sharding.case_runner import run_sharding_case
from paritykit.checks.sharding.cases import RankBatch, ShardingCase
from paritykit.checks.sharding.dmp_known_broken import RULES as DMP_RULES
from paritykit.checks.sharding.fp_known_broken import RULES as FP_RULES
from paritykit.checks.sharding.draws import sharding_cases
from paritykit.checks.sharding.known_broken import MIN_WORLD_SIZE, RULES, broken_rules, kept_out_rules, known_broken_cases, repair
from paritykit.checks.sharding.matrix import examples_per_plan_shape, placements_by_module
from paritykit.checks.sharding.pinned import pinned_cases
from paritykit.checks.sharding.plan_matrix import KNOWN_BROKEN as PLAN_KNOWN_BROKEN
from paritykit.errors import ParityError, RankFailure
from paritykit.gate.gating import run_checks
from paritykit.harness import plants
from paritykit.harness.tables import TableSpec


@pytest.mark.world_size(2)
@pytest.mark.parametrize("index", range(len(pinned_cases(2))))
def test_every_pinned_case_trains_like_the_unsharded_module_on_two_ranks(rank_pool, index):
    metrics = run_sharding_case(pinned_cases(2)[index], rank_pool)
    assert metrics["steps"] == 3 and metrics["ranks"] == 2 and metrics["state_tensors"] >= 1


@pytest.mark.world_size(1)
def test_pinned_cases_train_like_the_unsharded_module_on_one_rank(rank_pool):
    assert [run_sharding_case(case, rank_pool)["ranks"] for case in pinned_cases(1)] == [1] * len(pinned_cases(1))


@pytest.mark.world_size(3)
def test_column_wise_shards_on_three_ranks_in_a_permuted_order_train_like_the_unsharded_module(rank_pool):
    case = pinned_cases(3)[0]
    assert case.plan["t0"] == ("column_wise", (0, 2, 0))
    assert run_sharding_case(case, rank_pool)["ranks"] == 3


@pytest.mark.world_size(2)
@pytest.mark.parametrize("rule", [rule.name for rule in RULES])
def test_each_known_broken_combination_fails_inside_torchrec_as_its_rule_says(rank_pools, rule):
    world_size = max(MIN_WORLD_SIZE.get(rule, 1), 1)
    case = known_broken_cases(world_size)[rule]
    assert [r.name for r in broken_rules(case)] == [rule]
    if rule not in {r.name for r in kept_out_rules()}:
        # Its known-issues entry says the installed torchrec fixed it: then it must match the oracle.
        assert run_sharding_case(case, rank_pools.get(world_size))["steps"] == len(case.steps)
        return
    with pytest.raises((ParityError, RankFailure)):
        run_sharding_case(case, rank_pools.get(world_size))


@pytest.mark.parametrize("rule", [rule.name for rule in RULES])
def test_repairing_a_known_broken_case_leaves_no_rule_applying(rule):
    case = known_broken_cases(2)[rule]
    if rule == "row-wise-family-uneven-batch":
        pytest.skip("the draws avoid this one by construction (one batch size per step), not by repair")
    assert broken_rules(repair(case), kept_out_rules()) == []


def test_the_draws_stay_inside_what_torchrec_runs_and_cover_every_placement():
    # Drawn the way the gate draws them (the property runner: the same cases for the same seed).
    from paritykit.checks.runner import run_property

    seen: list[ShardingCase] = []
    run_property("sharding", sharding_cases(3, placements_by_module("cpu")), lambda case: seen.append(case) or {},
                 GateConfig(examples=150, seed=0, shrink=False), case_id=lambda case: case.case_id())
    assert all(broken_rules(case, kept_out_rules()) == [] for case in seen)
    assert {case.module for case in seen} == {"ec", "ebc"}
    for case in (c for c in seen if c.module == "ec"):
        assert len({t.embedding_dim for t in case.tables}) == 1
        assert all(case.kernel_of(t) == "fused" for t in case.plan)
    kinds = {entry[0] for case in seen for entry in case.plan.values()}
    assert kinds >= {"table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise", "grid_shard", "data_parallel"}


def test_dense_kernel_tables_that_share_a_batched_kernel_are_both_trained(rank_pools):
    # Dense-kernel tables on one rank share one TBE weight; a step that cleared one table's gradient
    # would clear the whole group's.
    tables = (TableSpec("t0", 4, 8, ("f0",)), TableSpec("t1", 4, 8, ("f1",)))
    batch = RankBatch((("f0", ((1,),)), ("f1", ((0,),))))
    case = ShardingCase("ebc", 2, tables, {"t0": ("column_wise", (0, 0)), "t1": ("column_wise", (0, 0))}, kernel="dense",
                        steps=((batch, batch),) * 3)
    assert run_sharding_case(case, rank_pools.get(2))["steps"] == 3


def test_the_gate_entry_passes_marks_the_known_broken_cases_and_counts_plan_shapes(paritykit_examples, rank_pools):
    config = GateConfig(world_sizes=(1, 2), examples=paritykit_examples, seed=1)
    results, _ = run_checks(["sharding"], config, rank_pools)
    failing = [r for r in results if r.status not in ("pass", "known-issue")]
    assert not failing, failing[0].message
    known = sorted(r.case_id.split()[1] for r in results if r.status == "known-issue")
    # A fixed one passes; the DMP block's, the FP cases' and the plan block's known-broken configurations run once each too,
    # and the towers' that one host shows (the other two need several hosts, which this config has none of).
    assert known == sorted([rule.name for rule in kept_out_rules()] + list(DMP_RULES) + list(FP_RULES) + list(PLAN_KNOWN_BROKEN)
                           + ["tower-sharding-cpu-ddp-device-ids"])
    counts = examples_per_plan_shape(results)
    assert sum(counts.values()) >= len(pinned_cases(1)) + len(pinned_cases(2))


def test_the_gate_entry_catches_a_planted_stitching_bug_naming_step_feature_and_element(rank_pools):
    # The pinned column-wise shards on ranks [0, 1, 0] alone (the whole entry runs in the self-test's subset).
    cw_010 = next(c for c in pinned_cases(2) if ("column_wise", (0, 1, 0)) in c.plan.values())
    config = GateConfig(world_sizes=(2,), hosts=(), examples=1, seed=0, shrink=False, case=cw_010.case_id())
    with plants.applied(["cw-permute-rank-order"]):
        results, _ = run_checks(["sharding"], config, rank_pools)
    failed = [r for r in results if r.status == "fail"]
    assert failed, "the planted stitching bug went unnoticed"
    message = failed[0].message
    assert "step 0, rank 0" in message and "f0@t0" in message and "first at" in message


def test_a_consistent_drift_of_1e_3_in_the_mean_divisor_fails(rank_pools):
    with plants.applied(["mean-divisor-epsilon-1e-3"]), pytest.raises(ParityError, match="returned other values"):
        run_sharding_case(pinned_cases(2)[4], rank_pools.get(2))


def test_an_unrepaired_drawn_case_shows_the_same_torchrec_defect(rank_pools):
    # The rule's repair is what keeps the draws green: undoing it brings the failure back.
    case = dataclasses.replace(pinned_cases(2)[4], tables=(TableSpec("t0", 10, 8, ("f0",), "MEAN"), TableSpec("t1", 8, 8, ("f1", "f2"))),
                               plan={"t0": ("row_wise",), "t1": ("table_wise", 1)})
    assert [r.name for r in broken_rules(case)] == ["ebc-row-wise-mean-beside-other-placements"]
    with pytest.raises(ParityError, match="returned other values"):
        run_sharding_case(case, rank_pools.get(2))


def test_under_a_launch_of_two_hosts_the_check_draws_for_the_launchs_hosts(monkeypatch):
    from paritykit.checks.runner import run_property
    from paritykit.checks.sharding.matrix import host_layouts
    from paritykit.harness.hosts import HostLayout
    from paritykit.harness.plans import local_world_size

    assert local_world_size(4) == 4  # outside any launch: one host
    assert host_layouts(GateConfig(world_sizes=(4,))) == [HostLayout(1, 4)]
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_world_size(4) == 2 and local_world_size(6) == 6  # another world than the launch's: one host
    assert local_world_size(4, ranks_per_host=4) == 4  # a pool's own hosts win over the environment
    assert host_layouts(GateConfig(world_sizes=(4,))) == [HostLayout(2, 2)]
    seen: list[ShardingCase] = []
    run_property("sharding", sharding_cases(4, {"ebc": ("table_column_wise", "table_row_wise"), "ec": ("table_wise",)}, ranks_per_host=2),
                 lambda case: seen.append(case) or {}, GateConfig(examples=30, seed=0, shrink=False), case_id=lambda c: c.case_id())
    twcw = [entry[1] for case in seen for entry in case.plan.values() if entry[0] == "table_column_wise"]
    assert twcw and all(len({rank // 2 for rank in ranks}) == 1 for ranks in twcw)  # each on one host's ranks
