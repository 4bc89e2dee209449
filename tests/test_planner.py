"""The planner check (paritykit/checks/planner): its rules on plans written by hand, its planted bugs
shown first to change the plan torchrec's planner makes, then caught by the self-test."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from paritykit.checks.planner.case_runner import kernels_offered, run_gpu_plan_case
from paritykit.checks.planner.cases import TableConstraint, model_fn
from paritykit.checks.planner.pinned import gpu_only_cases, pinned_cases
from paritykit.checks.planner.plan_rules import column_block, plan_problems
from paritykit.checks.planner.planning import plan_case
from paritykit.checks.runner import GateConfig
from paritykit.errors import ParityError
from paritykit.gate.selftest import run_clean, run_plant
from paritykit.harness import plants

PLANNER_PLANTS = sorted(name for name, plant in plants.PLANTS.items() if plant.check == "planner")
SELFTEST = GateConfig(device="cpu", world_sizes=(2,), examples=3, seed=0, shrink=False)


@pytest.mark.parametrize("dim, min_partition, width", [
    (16, 4, 4), (24, 8, 8), (24, None, 24), (12, 8, 12), (32, 12, 16), (8, 12, 8), (48, 4, 4),
])
def test_the_column_block_is_the_narrowest_multiple_of_4_from_min_partition_that_divides_the_dim(dim, min_partition, width):
    assert column_block(dim, min_partition) == width


def _planned(case):
    plan, report_problems = plan_case(case, model_fn(case)())
    assert report_problems == [], report_problems
    return plan


def _summary(plan) -> dict:
    return {name: (s.sharding_type, s.compute_kernel, tuple(s.ranks or ()),
                   tuple((tuple(m.shard_offsets), tuple(m.shard_sizes)) for m in (s.sharding_spec.shards if s.sharding_spec else ())))
            for module_plan in plan.plan.values() for name, s in module_plan.items()}


@pytest.mark.parametrize("case", pinned_cases(4, 2), ids=lambda case: case.module)
def test_torchrecs_plans_of_the_pinned_cases_keep_every_rule(case):
    assert plan_problems(case, _planned(case), kernels_offered(case.module)) == []


def test_a_plan_whose_shards_sit_elsewhere_than_its_ranks_or_on_two_hosts_is_named():
    case = pinned_cases(4, 2)[0]  # t1: table_column_wise, min_partition 8, on 2 hosts of 2 ranks
    plan = _planned(case)
    module_plan = next(iter(plan.plan.values()))
    cw, twcw = module_plan["t0"], module_plan["t1"]
    module_plan["t0"] = dataclasses.replace(cw, ranks=list(reversed(cw.ranks)))
    assert any("placed on ranks" in p and "'t0'" in p for p in plan_problems(case, plan, kernels_offered("ebc")))
    module_plan["t0"] = cw
    for shard, rank in zip(twcw.sharding_spec.shards, (0, 2, 0)):  # the second block on the other host
        shard.placement = type(shard.placement)(f"rank:{rank}/cpu")
    module_plan["t1"] = dataclasses.replace(twcw, ranks=[0, 2, 0])
    assert any("on more than one host" in p for p in plan_problems(case, plan, kernels_offered("ebc")))


def test_a_shard_placed_on_another_device_than_its_ranks_own_is_named():
    from paritykit.checks.planner.case_runner import _cuda_plan

    case = pinned_cases(4, 2)[0]
    plan, problems = _cuda_plan(case)
    assert problems == []
    shard = plan.plan[""]["t0"].sharding_spec.shards[-1]
    rank = shard.placement.rank()
    assert str(shard.placement.device()) == f"cuda:{rank % 2}"  # the rank's local GPU
    shard.placement = type(shard.placement)(f"rank:{rank}/cuda")
    assert any("'t0'" in p and "not cuda:" in p for p in plan_problems(case, plan, kernels_offered("ebc", "cuda"), "cuda"))


@pytest.mark.parametrize("world_size, ranks_per_host", [(2, 2), (4, 2), (6, 3)])
def test_torchrecs_gpu_plans_of_row_wise_table_row_wise_and_grid_keep_every_rule(world_size, ranks_per_host):
    case = gpu_only_cases(world_size, ranks_per_host)[0]
    assert run_gpu_plan_case(case)["plan_shape"].endswith("grid_shard+row_wise+table_row_wise")


def test_table_row_wise_or_grid_rows_on_two_hosts_or_out_of_order_are_named():
    case = gpu_only_cases(4, 2)[0]
    plan, _ = plan_case(case, model_fn(case)(), "cuda")
    module_plan = next(iter(plan.plan.values()))
    twrw, grid = module_plan["t0"], module_plan["t1"]
    first = twrw.sharding_spec.shards[0].placement.rank()
    other_host = (first + 2) % 4
    twrw.sharding_spec.shards[1].placement = type(twrw.sharding_spec.shards[1].placement)(f"rank:{other_host}/cuda:0")
    module_plan["t0"] = dataclasses.replace(twrw, ranks=[first, other_host])
    grid.sharding_spec.shards[0].shard_offsets, grid.sharding_spec.shards[1].shard_offsets = (
        grid.sharding_spec.shards[1].shard_offsets, grid.sharding_spec.shards[0].shard_offsets)
    problems = plan_problems(case, plan, kernels_offered("ebc", "cuda"))
    assert any("'t0'" in p and "over host" in p for p in problems), problems
    assert any("'t1'" in p and "over host" in p for p in problems), problems


def test_a_constraint_the_plan_does_not_keep_is_named():
    case = pinned_cases(2, 2)[1]
    case = dataclasses.replace(case, constraints=(("t0", TableConstraint(("table_wise",))),) + case.constraints[1:])
    plan = _planned(dataclasses.replace(case, constraints=pinned_cases(2, 2)[1].constraints))  # planned row-wise
    assert plan_problems(case, plan, kernels_offered("ec")) == [
        "table 't0' is planned row_wise; its constraints allow only ['table_wise']"]


def test_every_planner_plant_changes_the_plan_torchrecs_planner_makes():
    assert PLANNER_PLANTS
    for plant in PLANNER_PLANTS:
        changed = []
        for case in pinned_cases(2, 2):
            clean = _summary(_planned(case))
            with plants.applied([plant]):
                planted = _summary(_planned(case))
            changed.append(clean != planted)
            assert clean == _summary(_planned(case))  # and the plant is gone once the block ends
        assert any(changed), plant


@pytest.fixture(scope="module")
def clean_run(rank_pools):
    return run_clean("planner", SELFTEST, rank_pools)


@pytest.mark.parametrize("plant", PLANNER_PLANTS)
def test_self_test_catches_the_plant_with_the_planner_check(plant, clean_run, rank_pools):
    outcome = run_plant(plant, SELFTEST, rank_pools, clean_run)
    assert (outcome.verdict, outcome.check) == ("caught", "planner"), outcome.evidence


def test_the_planner_value_types_hold_and_a_storage_subtraction_dropping_ssd_is_caught(monkeypatch):
    from torchrec.distributed.planner import types

    from paritykit.checks.planner.value_types import value_type_case

    assert value_type_case()["storage_pairs"] == 16
    monkeypatch.setattr(types.Storage, "__sub__", lambda self, other: types.Storage(self.hbm - other.hbm, self.ddr - other.ddr))
    with pytest.raises(ParityError, match=r"Storage\(7, 11, 13\) - Storage\(2, 3, 5\)"):
        value_type_case()


def test_the_planner_callbacks_run_in_order_and_the_plan_follows_the_last_and_a_dropped_one_is_caught(monkeypatch):
    from torchrec.distributed.planner import planners

    from paritykit.checks.planner.callback_case import run_callback_case

    assert run_callback_case() == {"callbacks": 2, "tables": 3}
    # A planner that keeps its callbacks but never applies them.
    original = planners.EmbeddingShardingPlanner.__init__

    def forgetting(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._callbacks = []

    monkeypatch.setattr(planners.EmbeddingShardingPlanner, "__init__", forgetting)
    with pytest.raises(ParityError, match="the callbacks ran as \\[\\]"):
        run_callback_case()


def test_the_planner_spreads_equal_tables_over_hosts_and_a_tie_break_by_rank_is_caught(monkeypatch):
    from torchrec.distributed.planner import partitioners

    from paritykit.checks.planner.spread_case import SpreadCase, run_spread_case, spread_cases

    assert [case.count for case in spread_cases(2, 2)] == [2, 3, 4] and spread_cases(1, 4) == ()
    assert [run_spread_case(case)["tables"] for case in spread_cases(2, 2)] == [2, 3, 4]
    # A partitioner that breaks ties between ranks of equal load by rank alone fills host 0 first.
    monkeypatch.setattr(partitioners.OrderedDeviceHardware, "__lt__",
                        lambda self, other: (self.device.perf.total, self.device.rank) < (other.device.perf.total, other.device.rank))
    with pytest.raises(ParityError, match=r"put \[2, 0\] tables on the hosts"):
        run_spread_case(SpreadCase(2, 2, 2))


def test_the_plan_leaves_the_reserved_share_and_the_kjt_storage_free_and_a_reservation_without_the_kjts_is_caught(monkeypatch):
    from torchrec.distributed.planner import storage_reservations

    from paritykit.checks.planner.capacity import LARGE_BATCH, CapacityCase, run_capacity_case

    large = CapacityCase(batch_size=LARGE_BATCH)
    assert large.kjt_bytes() == 20 * 2**20  # 20 copies of 32768 int64 ids for each of 4 tables
    assert run_capacity_case(CapacityCase())["ranks"] == run_capacity_case(large)["ranks"] == 2
    # A reservation that computes the input KJTs' storage but never takes it from the ranks.
    monkeypatch.setattr(storage_reservations, "_reserve_kjt_storage",
                        lambda topology, batch_size, batch_inputs, input_data_type_size, multiplier:
                        storage_reservations._get_kjt_storage(topology, batch_inputs, input_data_type_size, multiplier))
    with pytest.raises(ParityError, match="left after the reservation"):
        run_capacity_case(large)


def test_torchrecs_proposers_propose_as_documented_and_a_greedy_order_reversed_is_caught(monkeypatch):
    from torchrec.distributed.planner import proposers

    from paritykit.checks.planner.proposer_case import run_proposer_case

    metrics = run_proposer_case()
    assert metrics["options"] == 64 and metrics["proposals"] > 61 + 81  # greedy's 1 + 4 x 15, the grid's 3^4, and more
    # Options ranked worst first: the greedy and uniform proposers start from each table's worst.
    score = proposers._sharding_option_score
    monkeypatch.setattr(proposers, "_sharding_option_score", lambda option, use_depth=True: -score(option, use_depth))
    with pytest.raises(ParityError, match="first proposal takes"):
        run_proposer_case()


def test_the_planner_refuses_what_fits_no_rank_with_the_right_reason_and_a_swapped_reason_is_caught():
    from paritykit.checks.planner.refusal_case import refusal_problems, run_refusal_case

    assert run_refusal_case()["refusals"] == 2
    message = ("Unable to find a plan ... 1) Increase the number of devices (2) ... Global storage available for model parallel: "
               "Storage(hbm = 0.106 GB, ddr = 0.125 GB), Global storage requirement for model parallel: Storage(hbm = 0.0 GB, "
               "ddr = 0.095 GB)) 3) Reduce local batch size (512)")
    assert refusal_problems(message, "STRICT_CONSTRAINTS", "STRICT_CONSTRAINTS", 400_000) == []
    assert any("expected INSUFFICIENT_STORAGE" in p for p in refusal_problems(message, "STRICT_CONSTRAINTS", "INSUFFICIENT_STORAGE", 400_000))
    # A requirement below the table's weights, or availability without the reservation taken off.
    assert any("less than the table's" in p for p in refusal_problems(message.replace("0.095", "0.05"), "STRICT_CONSTRAINTS",
                                                                         "STRICT_CONSTRAINTS", 400_000))
    assert any("less the reservation" in p for p in refusal_problems(message.replace("0.106", "0.125"), "STRICT_CONSTRAINTS",
                                                                        "STRICT_CONSTRAINTS", 400_000))


def test_the_memory_balanced_partitioner_keeps_its_tolerance_and_a_plan_beyond_it_is_caught():
    from paritykit.checks.planner.memory_balance_case import balance_problems, proposal, run_memory_balance_case
    from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner, MemoryBalancedPartitioner, SortBy

    fullest = run_memory_balance_case()["fullest_rank_hbm"]
    assert fullest[1] < fullest[0]  # at 50% the search finds a plan of less HBM on its fullest rank
    options, topology = proposal()
    original = GreedyPerfPartitioner(sort_by=SortBy.PERF).partition(copy.deepcopy(options), topology)
    looser = MemoryBalancedPartitioner(tolerance=0.5).partition(copy.deepcopy(options), topology)
    # The plan found at 50% held to the default 2%: beyond it.
    assert any("beyond 1.02 x" in p for p in balance_problems(original, looser, 0.02))
    # The greedy plan against the balanced one as if it were the original: more HBM on its fullest rank.
    assert any("more than the greedy plan's" in p for p in balance_problems(looser, original, 0.5))


def test_a_planner_keeping_the_worst_rated_plan_is_caught(monkeypatch):
    from torchrec.distributed.planner import perf_models

    from paritykit.checks.planner.proposer_case import planner_choice_problems

    assert planner_choice_problems() == []
    rate = perf_models.NoopPerfModel.rate
    monkeypatch.setattr(perf_models.NoopPerfModel, "rate", lambda self, plan: -rate(self, plan))
    assert any("chose a plan rated" in p for p in planner_choice_problems())
