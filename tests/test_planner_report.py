"""The rules for what torchrec's planner reports of its own plan (report_rules.py: the stats table's
box, its perf figures) and for every option's estimates (estimate_rules.py), each shown to pass on
torchrec's real report and estimates and to fail on one element changed."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from paritykit.checks.planner.cases import model_fn
from paritykit.checks.planner.pinned import pinned_cases
from paritykit.checks.planner.estimate_rules import single_problems
from paritykit.checks.planner.report_rules import (COLUMN_CUTTING, ONE_WIDER, frame_problems, imbalance,
                                                   imbalance_problems, maxima_problems, memory_problems,
                                                   negative_figure_problems, parameter_row_problems, perf_figure_problems,
                                                   rank_row_problems, shard_count_problems)


def _plan(device: str):
    """torchrec's real stats table, chosen plan and topology for the pinned EBC case on 2 hosts of 2,
    planned as the planner check plans it."""
    from paritykit.checks.planner.planning import planned_with_report

    case = pinned_cases(4, 2)[0]
    _, rows, best_plan, topo = planned_with_report(case, model_fn(case)(), device)
    return rows, best_plan, topo


@pytest.fixture(scope="module")
def planned():
    """torchrec's real stats table and chosen plan for the pinned EBC case on 2 hosts of 2."""
    return _plan("cpu")[:2]


@pytest.fixture(scope="module")
def planned_for_gpus():
    """The same, planned for GPU ranks (planning only), with the topology: HBM to report."""
    return _plan("cuda")


def test_torchrecs_own_report_keeps_the_rules(planned):
    rows, best_plan = planned
    assert rows and best_plan
    assert frame_problems(rows) == [] and perf_figure_problems(rows, best_plan) == [] and single_problems(best_plan, "cpu") == []
    assert shard_count_problems(rows, best_plan, 4) == parameter_row_problems(rows, best_plan) == []
    assert imbalance_problems(rows, best_plan, 4) == []


def test_the_maxima_memory_and_rank_rows_of_torchrecs_report_keep_the_rules_and_a_changed_one_is_caught(planned_for_gpus):
    from paritykit.checks.planner.planning import RESERVED_HBM

    rows, best_plan, topo = planned_for_gpus
    assert maxima_problems(rows, best_plan, 4) == [] and memory_problems(rows, topo, RESERVED_HBM) == []
    assert rank_row_problems(rows, best_plan, topo, RESERVED_HBM) == [] and negative_figure_problems(rows) == []
    # A storage amount of -1 byte prints as -0.0 GB.
    kernels = next(i for i, row in enumerate(rows) if "Compute Kernels Total Estimated Memory" in row)
    assert negative_figure_problems(_changed(rows, rows[kernels + 1], "SSD: 0.0", "SSD: -0.0"))
    # A consecutive run of ranks written one by one; the planning share printed as the reserved one.
    at = next(i for i, row in enumerate(rows) if "Maximum of Total Perf:" in row)
    ranks = rows[at].split(" on ")[1].split()[1]
    listed = ",".join(str(r) for r in range(int(ranks.split("-")[0]), int(ranks.split("-")[-1]) + 1))
    assert "-" in ranks  # the pinned plan's maximum lies on a run of ranks
    assert any("names the ranks" in p for p in maxima_problems(_changed(rows, "Maximum of Total Perf:", ranks, listed), best_plan, 4))
    planning = next(i for i, row in enumerate(rows) if "Planning Memory:" in row)
    wrong = rows[:planning + 2] + [rows[planning + 2].replace("85%", "15%")] + rows[planning + 3:]
    assert any("Planning Memory: is 15%" in p for p in memory_problems(wrong, topo, RESERVED_HBM))
    tier = next(r for r in rows if "Top Tier #1 " in r)
    assert any("tiers" in p for p in memory_problems(_changed(rows, tier, "#1 ", "#0 "), topo, RESERVED_HBM))
    rank0 = next(r for r in rows if r.split()[1:2] == ["0"] and ": " in r)
    share = rank0.split("(")[1].split(")")[0]  # the first "(..%)": rank 0's HBM share
    assert any("rank 0 HBM" in p for p in rank_row_problems(_changed(rows, rank0, f"({share})", "(99%)"), best_plan, topo, RESERVED_HBM))


def test_the_imbalance_statistics_are_zero_when_even_and_one_when_all_on_one_rank():
    assert imbalance([0.25] * 4) == pytest.approx({"Total Variation": 0, "Total Distance": 0, "Chi Divergence": 0, "KL Divergence": 0})
    assert imbalance([1.0, 0.0, 0.0]) == pytest.approx({"Total Variation": 2 / 3, "Total Distance": 4 / 3, "Chi Divergence": 1.0,
                                                        "KL Divergence": 1.0})


def _changed(rows: list[str], marker: str, old: str, new: str) -> list[str]:
    at = next(i for i, row in enumerate(rows) if marker in row)
    return rows[:at] + [rows[at].replace(old, new, 1)] + rows[at + 1:]


def test_a_miscounted_shard_a_wrong_rank_or_imbalance_figure_is_caught(planned):
    rows, best_plan = planned
    first = best_plan[0]
    row = next(r for r in rows if f" {first.fqn} " in r)
    ranks = row.split()[-2]  # the last cell before the closing '#'
    wrong_ranks = _changed(rows, f" {first.fqn} ", f" {ranks} ", " 9 ")
    assert any("ranks '9'" in p for p in parameter_row_problems(wrong_ranks, best_plan))
    for before, after, column in ((" pooled ", " sequence ", "Output"), (" unweighted ", " weighted ", "Weighted")):
        assert any(f"{first.fqn} {column}" in p for p in parameter_row_problems(_changed(rows, f" {first.fqn} ", before, after), best_plan))
    # A table whose shards keep all its columns printed with a shard width beside them.
    whole = next(o for o in best_plan if o.sharding_type not in COLUMN_CUTTING)
    dim = str(whole.tensor.shape[1])
    wide = _changed(rows, f" {whole.fqn} ", f" {dim} ", f" {dim} ({dim}) ")
    assert any(f"{whole.fqn} Emb Dim (CW Dim)" in p for p in parameter_row_problems(wide, best_plan))
    shards = next(r for r in rows if r.split()[1:2] == ["0"] and ": " in r)  # rank 0's row
    kind, count = shards.split()[-3].rstrip(":"), shards.split()[-2]
    wrong_count = _changed(rows, shards, f"{kind}: {count}", f"{kind}: {int(count) + 1}")
    assert any("rank 0's shards" in p for p in shard_count_problems(wrong_count, best_plan, 4))
    at = next(i for i, row in enumerate(rows) if "Total Variation:" in row)
    for value in ("0.900", "n/a"):
        wrong_tv = rows[:at] + [f"# Total Variation: {value} #"] + rows[at + 1:]
        assert any(f"Total Variation {value}" in p for p in imbalance_problems(wrong_tv, best_plan, 4))


def test_a_row_wider_or_narrower_than_the_border_is_caught(planned):
    rows, _ = planned
    blank = next(i for i, row in enumerate(rows) if " " in row and not row[1:-1].strip())
    for wrong in ("#" + " " * (2 * len(rows[0])) + "#", "#" + " " * 10 + "#"):
        problems = frame_problems(rows[:blank] + [wrong] + rows[blank + 1:])
        assert len(problems) == 1 and f"row {blank}" in problems[0], problems
    assert any(row.startswith(ONE_WIDER) for row in rows), "the tolerated row is in torchrec's table"


def test_a_printed_perf_figure_off_by_more_than_its_rounding_is_caught(planned):
    rows, best_plan = planned
    at = next(i for i, row in enumerate(rows) if "Sum of Maxima:" in row)
    wrong = rows[:at] + ["# Sum of Maxima: 9.5 ms #"] + rows[at + 1:]
    problems = perf_figure_problems(wrong, best_plan)
    assert len(problems) == 1 and "Sum of Maxima: 9.5 ms" in problems[0], problems


def test_a_shard_estimated_below_its_weights_and_output_is_caught(planned):
    _, best_plan = planned
    option = best_plan[0]
    shard = option.shards[0]
    rows, columns = shard.size
    least = rows * columns * 4 + option.batch_size * columns * 4
    saved = shard.storage
    try:
        shard.storage = dataclasses.replace(saved, hbm=0, ddr=least - 1)
        problems = single_problems(best_plan, "cpu")
        assert len(problems) == 1 and f"table {option.name!r}" in problems[0] and str(least) in problems[0], problems
        shard.storage = dataclasses.replace(saved, hbm=0, ddr=least)
        assert single_problems(best_plan, "cpu") == []
    finally:
        shard.storage = saved


def _options(device: str, batch: int) -> list:
    from paritykit.checks.planner.planning import enumerated

    return enumerated(pinned_cases(2, 2)[0], device, batch, constrained=False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchrecs_estimates_keep_their_meaning_and_a_changed_one_is_caught(device):
    from paritykit.checks.planner.estimate_rules import batch_problems, degenerate_problems, single_problems

    single, double = _options(device, 512), _options(device, 1024)
    assert single_problems(single, device) == [] and batch_problems(single, double, device) == []
    assert degenerate_problems(single, device, one_host=True) == []
    # One shard's forward compute not doubling with the batch; a one-shard column-wise option moved off table-wise.
    shard = next(o for o in double if o.sharding_type == "table_wise").shards[0]
    shard.perf = dataclasses.replace(shard.perf, fwd_compute=shard.perf.fwd_compute * 1.5)
    problems = batch_problems(single, double, device)
    assert len(problems) == 1 and "fwd_compute" in problems[0] and "with the batch doubled" in problems[0], problems
    cw = next(o for o in single if o.sharding_type == "column_wise" and len(o.shards) == 1)
    cw.shards[0].perf = dataclasses.replace(cw.shards[0].perf, bwd_comms=cw.shards[0].perf.bwd_comms + 1e-3)
    problems = degenerate_problems(single, device, one_host=True)
    assert len(problems) == 1 and f"table {cw.name!r} column_wise" in problems[0], problems
    cw.shards[0].perf = dataclasses.replace(cw.shards[0].perf, fwd_compute=-1.0)
    assert any("fwd_compute=-1.0" in p for p in single_problems(single, device))


def _traffic(device: str, pooling_factor: float, num_poolings: float, rows: int = 1, columns: int = 1) -> list:
    from paritykit.checks.planner.planning import _scaled, enumerated

    return enumerated(_scaled(pinned_cases(2, 2)[0], rows, columns), device, 512, False, (pooling_factor, num_poolings))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_estimates_follow_ids_bags_and_rows_and_a_changed_one_is_caught(device):
    from paritykit.checks.planner.estimate_rules import (ceiling_problems, columns_problems, num_poolings_problems,
                                                         pooling_factor_problems, rows_problems)

    base = _traffic(device, 2.0, 1.0)
    more_ids, more_bags, more_rows = _traffic(device, 4.0, 1.0), _traffic(device, 2.0, 2.0), _traffic(device, 2.0, 1.0, rows=2)
    wider = _traffic(device, 2.0, 1.0, columns=2)
    assert pooling_factor_problems(base, more_ids, device) == []
    assert num_poolings_problems(base, more_bags, device) == []
    assert rows_problems(base, more_rows, device, world_size=2) == []
    assert columns_problems(base, wider, device) == []
    assert ceiling_problems(base, device, world_size=2) == []
    narrow = next(o for o in wider if o.sharding_type == "table_wise")
    narrow.shards[0].perf = dataclasses.replace(narrow.shards[0].perf, fwd_comms=narrow.shards[0].perf.fwd_comms / 4)
    problems = columns_problems(base, wider, device)
    assert len(problems) == 1 and "fwd_comms" in problems[0] and "the columns doubled" in problems[0], problems
    # A pooled table's output transfer growing with its ids; a bag more not doubling the compute;
    # a shard of a placement holding every row of its table.
    pooled = next(o for o in more_ids if o.is_pooled and o.sharding_type == "table_wise")
    pooled.shards[0].perf = dataclasses.replace(pooled.shards[0].perf, fwd_comms=pooled.shards[0].perf.fwd_comms * 2)
    problems = pooling_factor_problems(base, more_ids, device)
    assert len(problems) == 1 and "fwd_comms" in problems[0] and "ids per bag" in problems[0], problems
    bags = next(o for o in more_bags if o.sharding_type == "table_wise")
    bags.shards[0].perf = dataclasses.replace(bags.shards[0].perf, bwd_compute=bags.shards[0].perf.bwd_compute * 1.5)
    problems = num_poolings_problems(base, more_bags, device)
    assert len(problems) == 1 and "bwd_compute" in problems[0] and "bags per sample" in problems[0], problems
    split = next(o for o in more_rows if o.sharding_type != "data_parallel" and o.compute_kernel != "fused_uvm_caching")
    shard = split.shards[0]
    shard.storage = dataclasses.replace(shard.storage, ddr=shard.storage.ddr + shard.storage.hbm + 4096)
    problems = rows_problems(base, more_rows, device, world_size=2)
    assert len(problems) == 1 and f"table {split.name!r} {split.sharding_type}" in problems[0], problems


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_backward_compute_follows_the_topologys_multiplier_and_a_changed_one_is_caught(device):
    from torchrec.distributed.planner.constants import BWD_COMPUTE_MULTIPLIER

    from paritykit.checks.planner.estimate_rules import bwd_multiplier_problems
    from paritykit.checks.planner.planning import enumerated

    case = pinned_cases(2, 2)[0]
    base = enumerated(case, device, 512, False, (2.0, 1.0))
    doubled = enumerated(case, device, 512, False, (2.0, 1.0), bwd_compute_multiplier=2 * BWD_COMPUTE_MULTIPLIER)
    assert bwd_multiplier_problems(base, doubled, device) == []
    assert any(o.shards[0].perf.bwd_compute > 0 for o in base)  # something to double
    # A backward that ignores the multiplier; a forward that follows it.
    first, second = [o for o in doubled if o.shards[0].perf.bwd_compute > 0 and o.shards[0].perf.fwd_compute > 0][:2]
    first.shards[0].perf = dataclasses.replace(first.shards[0].perf, bwd_compute=first.shards[0].perf.bwd_compute / 2)
    second.shards[0].perf = dataclasses.replace(second.shards[0].perf, fwd_compute=second.shards[0].perf.fwd_compute * 2)
    problems = bwd_multiplier_problems(base, doubled, device)
    assert len(problems) == 2 and "bwd_compute" in problems[0] and "fwd_compute" in problems[1], problems
    assert all("bwd_compute_multiplier doubled" in p for p in problems)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compute_below_the_bytes_moved_or_less_for_weighted_features_is_caught(device):
    from paritykit.checks.planner.estimate_floors import compute_floor, floor_problems, storage_floor
    from paritykit.checks.planner.estimate_rules import weighted_problems
    from paritykit.checks.planner.planning import enumerated, topology

    case = pinned_cases(2, 2)[0]
    base, weighted = _traffic(device, 2.0, 1.0), enumerated(case, device, 512, False, (2.0, 1.0), weighted=True)
    topo = topology(case, device)
    assert floor_problems(base, device, topo) == [] and weighted_problems(base, weighted, device) == []
    # A forward estimated at 90% of the bytes its shard must move; a weighted table's backward
    # estimated below the unweighted one's (its weights' gradient subtracted instead of added).
    option = next(o for o in base if o.sharding_type == "column_wise")
    shard = option.shards[0]
    shard.perf = dataclasses.replace(shard.perf, fwd_compute=0.9 * compute_floor(option, shard, topo, device))
    problems = floor_problems(base, device, topo)
    assert len(problems) == 1 and "fwd_compute" in problems[0] and f"table {option.name!r} column_wise" in problems[0], problems
    # ... and its storage short of its step's ids by a byte.
    shard.storage = dataclasses.replace(shard.storage, hbm=0, ddr=math.ceil(storage_floor(option, shard, topo.world_size)) - 1)
    problems = floor_problems(base, device, topo)
    assert len(problems) == 2 and "storage" in problems[1] and "output vectors" in problems[1], problems
    # A forward estimated in bytes, not milliseconds: beyond the ceiling.
    from paritykit.checks.planner.estimate_floors import compute_ceiling_problems

    assert compute_ceiling_problems(base, device, topo) == []
    estimated = shard.perf
    shard.perf = dataclasses.replace(estimated, fwd_compute=compute_floor(option, shard, topo, device) * topo.ddr_mem_bw)
    problems = compute_ceiling_problems(base, device, topo)
    assert len(problems) == 1 and "fwd_compute" in problems[0] and "slowest bandwidth" in problems[0], problems
    shard.perf = estimated
    heavier = next(o for o in weighted if o.sharding_type == "table_wise").shards[0]
    heavier.perf = dataclasses.replace(heavier.perf, bwd_compute=0.5 * heavier.perf.bwd_compute)
    problems = weighted_problems(base, weighted, device)
    assert problems and all("bwd_compute" in p and "with the features weighted" in p for p in problems), problems


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_input_distribution_faster_than_its_ids_can_travel_is_caught(device):
    from paritykit.checks.planner.estimate_floors import floor_problems, input_dist_floor
    from paritykit.checks.planner.planning import topology

    case = pinned_cases(2, 2)[0]
    base, topo = _traffic(device, 2.0, 1.0), topology(case, device)
    option = next(o for o in base if o.sharding_type == "table_wise")
    shard = option.shards[0]
    if not hasattr(shard.perf, "input_dist_comms"):
        pytest.skip("this torchrec's Perf has no input_dist_comms")
    assert floor_problems(base, device, topo) == [] and shard.perf.input_dist_comms >= input_dist_floor(option, shard, topo) > 0
    # The ids counted in bytes over their 8-byte size (a `*` become `//`): 64 times too fast.
    shard.perf = dataclasses.replace(shard.perf, input_dist_comms=shard.perf.input_dist_comms / 64)
    problems = floor_problems(base, device, topo)
    assert len(problems) == 1 and "input_dist_comms" in problems[0], problems


def test_a_uvm_cache_smaller_than_its_load_factor_is_caught():
    from paritykit.checks.planner.estimate_rules import cache_problems
    from paritykit.checks.planner.planning import CACHE_LOAD_FACTOR

    base = _traffic("cuda", 2.0, 1.0)
    assert cache_problems(base, "cuda", CACHE_LOAD_FACTOR) == []
    cached = next(o for o in base if o.compute_kernel == "fused_uvm_caching" and o.sharding_type == "table_wise")
    uncached = next(o for o in base if o.compute_kernel == "fused_uvm" and o.sharding_type == "table_wise" and o.name == cached.name)
    shard = cached.shards[0]
    # The cache sized at a tenth of the rows, not the load factor's share.
    rows, columns = shard.size
    shard.storage = dataclasses.replace(shard.storage, hbm=uncached.shards[0].storage.hbm + rows * columns * 4 // 10)
    problems = cache_problems(base, "cuda", CACHE_LOAD_FACTOR)
    assert len(problems) == 1 and f"table {cached.name!r} table_wise/fused_uvm_caching" in problems[0], problems


def test_a_rank_planned_beyond_its_memory_is_caught():
    from types import SimpleNamespace as NS

    from paritykit.checks.planner.planning import capacity_problems

    topo = NS(devices=[NS(storage=NS(hbm=100, ddr=1000)), NS(storage=NS(hbm=100, ddr=1000))])
    shard = lambda rank, hbm, ddr: NS(rank=rank, storage=NS(hbm=hbm, ddr=ddr))  # noqa: E731
    fits = [NS(shards=[shard(0, 60, 10), shard(1, 100, 0)]), NS(shards=[shard(0, 40, 990)])]
    assert capacity_problems(fits, topo, "cuda") == []
    over = fits + [NS(shards=[shard(1, 1, 0)])]
    assert capacity_problems(over, topo, "cuda") == ["rank 1 on cuda: the plan's shards need 101 bytes of hbm, "
                                                     "the topology gives it 100"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_shard_estimated_above_its_weights_and_traffic_is_caught(device):
    from paritykit.checks.planner.estimate_rules import ceiling_problems

    base = _traffic(device, 2.0, 1.0)
    assert ceiling_problems(base, device, world_size=2) == []
    # Six times the output bytes (an output dtype's bits minus 8, not over 8): above every rank's outputs.
    tw = next(o for o in base if o.sharding_type == "table_wise")
    shard = tw.shards[0]
    outputs = tw.batch_size * tw.num_inputs * shard.size[1] * 4 * 2
    shard.storage = dataclasses.replace(shard.storage, ddr=shard.storage.ddr + 5 * outputs)
    problems = ceiling_problems(base, device, world_size=2)
    assert len(problems) == 1 and f"table {tw.name!r} table_wise" in problems[0], problems


def test_the_capacity_case_passes_and_a_plan_into_the_reserved_memory_is_caught(monkeypatch):
    from paritykit.checks.planner import capacity
    from paritykit.errors import ParityError

    metrics = capacity.run_capacity_case(capacity.CapacityCase())
    assert metrics["ranks"] == 2 and metrics["hbm_used_max"] <= (1 - capacity.RESERVED) * capacity.HBM_PER_RANK
    # The rule held to a larger reservation than the planner was given: its plan fills the difference.
    from torchrec.distributed.planner import storage_reservations

    real = capacity.RESERVED
    monkeypatch.setattr(capacity, "RESERVED", 0.5)
    original = storage_reservations.HeuristicalStorageReservation
    monkeypatch.setattr(storage_reservations, "HeuristicalStorageReservation", lambda percentage: original(percentage=real))
    with pytest.raises(ParityError, match="more than the 50% of its"):
        capacity.run_capacity_case(capacity.CapacityCase())


def test_the_compute_kernels_count_is_the_plans_tables_per_kernel():
    from types import SimpleNamespace

    from paritykit.checks.planner.report_blocks import kernel_count_problems

    rows = ["#" * 40, "#  Compute Kernels Count:             #", "#    dense: 1                        #",
            "#    fused: 2                        #", "#                                    #"]
    plan = [SimpleNamespace(compute_kernel=k) for k in ("fused", "dense", "fused")]
    assert kernel_count_problems(rows, plan) == []
    assert "printed {'dense': 1, 'fused': 2}" in kernel_count_problems(rows, plan[:2])[0]
    assert "no 'Compute Kernels Count:' block" in kernel_count_problems(rows[:1], plan)[0]


def test_the_peak_hbm_tiers_name_every_rank_when_fewer_than_five():
    from paritykit.checks.planner.report_blocks import printed_ranks, tier_problems

    assert printed_ranks("0-2,5") == [0, 1, 2, 5] and printed_ranks("0,0,1") == [0, 0, 1] and printed_ranks("none") == []
    top = "# Top HBM Memory Usage Estimation: 0.001 GB #"
    rows = [top, "# Top Tier #2 Estimated Peak HBM Pressure: 0.001 GB on rank 2 #",
            "# Top Tier #1 Estimated Peak HBM Pressure: 0.002 GB on ranks 0-1 #"]
    assert tier_problems(rows, 3) == []
    assert "every rank of 4 is in one" in tier_problems(rows, 4)[0]
    assert "every rank of 3 is in one" in tier_problems(rows[:1], 3)[0]
    assert "not numbered 1, 2" in tier_problems([top, rows[1]], 3)[0]


@pytest.fixture(scope="module", params=["cuda", "cpu"])
def many_tables(request):
    """torchrec's real stats table, chosen plan and topology for the report case (8 column-wise tables and a
    dense layer), planned for GPU ranks and for CPU ranks."""
    from paritykit.checks.planner.report_case import planned_report

    return planned_report(request.param)


def _replaced(rows: list[str], pattern: str, new: str) -> list[str]:
    changed = [re.sub(pattern, new, row) for row in rows]
    assert changed != rows, pattern
    return changed


def test_the_report_case_keeps_every_rule_and_names_five_of_its_eight_tables(many_tables):
    from paritykit.checks.planner.report_case import report_case_problems, run_report_case
    from paritykit.checks.planner.report_summary import top_tables

    rows, best_plan, topology = many_tables
    assert report_case_problems(rows, best_plan, topology) == []
    assert len(top_tables(best_plan, "perf")[0]) == len(top_tables(best_plan, "hbm")[0]) == 8
    assert run_report_case(topology.compute_device)["tables"] == 8


def test_a_wrong_critical_path_top_table_list_or_index_count_is_caught(many_tables):
    from paritykit.checks.planner.report_case import report_case_problems
    from paritykit.checks.planner.report_summary import critical_path

    rows, best_plan, topology = many_tables
    comms, compute = critical_path(best_plan)
    assert compute > 0.01 and comms >= 0
    # The compute part without the forward pass (what a sum dropping it prints).
    wrong = _replaced(rows, r"Critical Path \(compute\): \S+", f"Critical Path (compute): {round(compute * 0.5, 3)}")
    assert any("Critical Path (compute)" in p for p in report_case_problems(wrong, best_plan, topology))
    # A sixth table listed, or the smallest listed in place of the largest.
    at = next(i for i, row in enumerate(rows) if "Top 5 Tables Causing Max Perf:" in row)
    sixth = rows[:at + 2] + [rows[at + 1]] + rows[at + 2:]
    assert any("lists the 5 largest" in p for p in report_case_problems(sixth, best_plan, topology))
    last_hbm = next(i for i, row in enumerate(rows) if "Top 5 Tables Causing Max HBM:" in row) + 5
    entry = rows[last_hbm]
    wrong_gb = rows[:last_hbm] + [entry.replace(" GB on", "1 GB on", 1)] + rows[last_hbm + 1:]
    assert any("the plan's shards of" in p for p in report_case_problems(wrong_gb, best_plan, topology))
    # Num Indices as pooling factor minus poolings.
    t2 = next(i for i, row in enumerate(rows) if row.strip("# ").startswith("ebc.t2 "))
    wrong_indices = rows[:t2] + [rows[t2].replace(" 10.5 ", " 0.5 ", 1)] + rows[t2 + 1:]
    assert wrong_indices != rows
    assert any("Num Indices 0.5" in p for p in report_case_problems(wrong_indices, best_plan, topology))
    # The dense layer's storage on the other memory, or not multiplied.
    dense = next(i for i, row in enumerate(rows) if "Dense Storage (per rank):" in row) + 1
    for wrong_row in (rows[dense].replace("HBM:", "DDR:").replace(", DDR:", ", HBM:"), re.sub(r"[0-9.]+ GB", "0.008 GB", rows[dense])):
        wrong_dense = rows[:dense] + [wrong_row] + rows[dense + 1:]
        assert any("dense storage" in p for p in report_case_problems(wrong_dense, best_plan, topology))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_weighted_table_estimated_no_more_than_unweighted_is_caught(device):
    from paritykit.checks.planner.estimate_rules import weighted_problems
    from paritykit.checks.planner.planning import enumerated

    case = pinned_cases(2, 2)[0]
    base, weighted = _traffic(device, 2.0, 1.0), enumerated(case, device, 512, False, (2.0, 1.0), weighted=True)
    assert weighted_problems(base, weighted, device) == []
    # The weights ignored (the weighted flag read as unset): every estimate the unweighted one's.
    twin = next(o for o in weighted if o.sharding_type == "table_wise")
    plain = next(o for o in base if (o.name, o.sharding_type, o.compute_kernel, len(o.shards)) ==
                 (twin.name, twin.sharding_type, twin.compute_kernel, len(twin.shards)))
    for heavy, light in zip(twin.shards, plain.shards):
        heavy.perf = light.perf
    problems = weighted_problems(base, weighted, device)
    assert len(problems) == 1 and "estimated no more with its features weighted" in problems[0], problems
