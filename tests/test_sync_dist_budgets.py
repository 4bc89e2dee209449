"""Rank-pool sync budgets (world size 2): every budget exact per rank and call site; the sharded
EBC's input_dist and one step of each pipeline.

The counts and their torchrec call sites are justified in paritykit/checks/sync/dist_budget.py,
ebc_dist_budgets.py and ec_dist_budgets.py; the sharded EC's own tests are in
test_sync_ec_dist_budgets.py.
"""

from __future__ import annotations

import pytest

from paritykit.harness import plants
from paritykit.checks import load_check
from paritykit.checks.runner import GateConfig
from paritykit.checks.sync.budgets import BUDGETS, DIST_BUDGETS, DIST_BUDGETS_BY_NAME as BY_NAME
from paritykit.checks.sync.dist_budget import LENGTH_PER_KEY, measure_dist, sites_of
from paritykit.checks.sync.ebc_dist_budgets import FUSED_OVERFLOW_LOG_READS, INPUT_DIST_BUDGETS, PIPELINE_BUDGETS
from paritykit.checks.sync.matrix import run_dist_budget
from paritykit.gate.selftest import run_plant


@pytest.mark.parametrize("budget", DIST_BUDGETS, ids=[b.name for b in DIST_BUDGETS])
def test_each_rank_makes_exactly_its_budgeted_syncs_at_the_named_torchrec_sites(budget, rank_pool, paritykit_device):
    records_per_rank, _ = measure_dist(budget, rank_pool, paritykit_device)
    assert len(records_per_rank) == 2
    for rank, records in enumerate(records_per_rank):
        for record in records:
            # Exact per call site: a sync added, removed or moved in torchrec shows up here.
            assert sites_of(record) == dict(sorted(budget.sites[rank].items())), f"rank {rank}:\n{record.describe()}"
            assert record.total == budget.budgets[rank]
            # Every sync is torchrec's: the regions (and paritykit's plain loop) add none of their own.
            assert all(site.startswith("torchrec/") for site in record.by_site)


def test_input_dist_budgets_are_the_counts_measured_per_rank():
    # The table the justification derives; both ranks receive features under both plans.
    assert {b.name: b.budgets for b in INPUT_DIST_BUDGETS} == {
        "ebc_input_dist.ws2.table_wise.kjt_moved_with_metadata": (7, 7),
        "ebc_input_dist.ws2.table_wise.kjt_without_metadata": (8, 8),
        "ebc_input_dist.ws2.row_wise.kjt_moved_with_metadata": (8, 8),
        "ebc_input_dist.ws2.row_wise.kjt_without_metadata": (9, 9),
    }


@pytest.mark.parametrize("plan", ["table_wise", "row_wise"])
def test_moved_kjt_metadata_saves_exactly_the_read_of_length_per_key_in_split(plan, rank_pool, paritykit_device):
    with_metadata, _ = measure_dist(BY_NAME[f"ebc_input_dist.ws2.{plan}.kjt_moved_with_metadata"], rank_pool, paritykit_device)
    without, raw = measure_dist(BY_NAME[f"ebc_input_dist.ws2.{plan}.kjt_without_metadata"], rank_pool, paritykit_device)
    for rank in (0, 1):
        moved, plain = sites_of(with_metadata[rank][0]), sites_of(without[rank][0])
        assert plain[LENGTH_PER_KEY] - moved[LENGTH_PER_KEY] == 1
        assert {k: v for k, v in plain.items() if k != LENGTH_PER_KEY} == {k: v for k, v in moved.items() if k != LENGTH_PER_KEY}
    # The plan the counts assume: table-wise gives t0's f0 to rank 0 and t1's f1, f2 to rank 1.
    expected_keys = [[["f0"]], [["f1", "f2"]]] if plan == "table_wise" else [[["f0", "f1", "f2"]]] * 2
    assert [result["received_keys"] for result in raw] == expected_keys


def test_warm_up_and_draining_calls_differ_from_the_budgeted_steady_step(rank_pool, paritykit_device):
    # Why the budget counts progress() calls 1 and 2 rather than the whole run divided by steps.
    totals = {b.args[0]: measure_dist(b, rank_pool, paritykit_device)[1][0]["totals"] for b in PIPELINE_BUDGETS}
    for name, per_call in totals.items():
        steady = BY_NAME[f"pipeline_step.ws2.dlrm.{name}"].budgets[0]
        assert per_call[1] == per_call[2] == steady
        assert per_call[0] > steady  # first-batch validation, lazy buffers, pipeline fill
    assert totals["plain"] == totals["base"] == [31, 17, 17, 17, 17]
    assert totals["sparse_dist"] == totals["fused:data_dist"] == [51, 22, 22, 22, 2]
    assert totals["semi_sync"] == [73, 22, 22, 2, 0]


def test_sparse_dist_pipelines_pay_the_fused_splits_overflow_log_reads_that_base_does_not():
    base, sparse_dist = BY_NAME["pipeline_step.ws2.dlrm.base"], BY_NAME["pipeline_step.ws2.dlrm.sparse_dist"]
    for rank in (0, 1):
        assert FUSED_OVERFLOW_LOG_READS not in base.sites[rank]
        assert sparse_dist.sites[rank][FUSED_OVERFLOW_LOG_READS] == 7
    assert [s - b for s, b in zip(sparse_dist.budgets, base.budgets)] == [5, 5]


def test_sync_check_runs_the_rank_pool_budgets_and_they_pass(rank_pools, paritykit_device):
    results = load_check("sync").run(GateConfig(device=paritykit_device), rank_pools)
    assert [r.case_id for r in results] == [b.name for b in BUDGETS] + [b.name for b in DIST_BUDGETS]
    dist_results = {r.case_id: r for r in results[len(BUDGETS):]}
    assert {name: r.status for name, r in dist_results.items()} == {b.name: "pass" for b in DIST_BUDGETS}
    assert dist_results["pipeline_step.ws2.dlrm.sparse_dist"].metrics["syncs_per_rank"] == [[22, 22], [20, 20]]


def test_sync_check_skips_the_rank_pool_budgets_without_world_size_2(rank_pools):
    results = load_check("sync").run(GateConfig(device="cpu", world_sizes=(1,)), rank_pools)
    skipped = {r.case_id: r.message for r in results if r.status == "skip"}
    assert {b.name for b in DIST_BUDGETS} <= set(skipped)
    assert skipped[DIST_BUDGETS[0].name] == "needs world size 2"


def test_planted_tolist_in_the_kjt_all_to_all_path_fails_every_rank_pool_budget(rank_pool, paritykit_device):
    config = GateConfig(device=paritykit_device)
    with plants.applied(["tolist-in-kjt-dist-splits"]):
        results = [run_dist_budget(budget, config, rank_pool) for budget in DIST_BUDGETS]
    assert {r.case_id: r.status for r in results} == {b.name: "fail" for b in DIST_BUDGETS}
    for result, budget in zip(results, DIST_BUDGETS):
        # One more sync than budgeted on each rank (one dist_splits per module per step on the
        # budgeted pipelines: two modules, so two more), named at the planted line.
        extra = 2 if budget.kind == "pipeline" else 1
        for rank, limit in enumerate(budget.budgets):
            assert f"{limit + extra} synchronization(s), budget {limit}" in result.message
            assert f"{budget.name} on rank {rank}" in result.message
        assert "in dist_splits_with_planted_tolist" in result.message
    # Gone after the block: the same budgets pass again.
    assert run_dist_budget(DIST_BUDGETS[0], config, rank_pool).status == "pass"


def test_self_test_catches_the_kjt_dist_splits_plant_with_the_sync_check(rank_pools, paritykit_device):
    outcome = run_plant("tolist-in-kjt-dist-splits", GateConfig(device=paritykit_device), rank_pools)
    assert (outcome.check, outcome.verdict) == ("sync", "caught")
