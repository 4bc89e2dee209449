"""Sharded td-kjt: sharded TD == sharded KJT == unsharded (EBC and EC, VBE included), on the rank pool;
what torchrec refuses; the configurations known to fail inside torchrec."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from paritykit.checks.runner import GateConfig
from paritykit.checks.td_kjt import cases as td_kjt
from paritykit.checks.td_kjt.batches import oracle_kjt, route_input
from paritykit.checks.td_kjt.known_broken import (
    KJT_AFTER_TD,
    kjt_after_td_case,
    rw_mean_beside_others_case,
    vbe_broken_cases,
)
from paritykit.checks.td_kjt.pinned import pinned_case, pinned_cases
from paritykit.checks.td_kjt.rank import (
    TD_VS_KJT,
    VS_UNSHARDED,
    report_case_on_rank,
    shard_case,
)
from paritykit.checks.td_kjt.sharded_draw import sharded_cases
from paritykit.checks.td_kjt.sharded_spec import (
    ROUTE_KJT,
    ROUTE_PARITYKIT,
    ROUTE_TORCHREC,
    RankBatch,
)
from paritykit.errors import HarnessError, ParityError, RankFailure
from paritykit.checks.known_issues import KnownIssue, apply
from paritykit.harness.tables import TableSpec
from paritykit.strategies import SparseBatch

CPU = torch.device("cpu")
EBC_TABLES = (TableSpec("t0", 8, 4, ("f0", "f1")), TableSpec("t1", 6, 4, ("f2",)), TableSpec("t2", 7, 4, ("f3",)))
TW_PLAN = {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("table_wise", 1)}


# ---------------------------------------------------------------- the batch forms (no ranks)


def test_oracle_expands_each_feature_by_its_inverse_indices() -> None:
    batch = SparseBatch(keys=("f0", "f1"), lengths=((2, 1), (0, 1, 3)), id_bounds=(9, 9), seed=4, weighted=True)
    kjt = oracle_kjt(RankBatch(batch, ((1, 0, 1), (2, 2, 1))), CPU)
    ids0, ids1 = batch.ids("f0"), batch.ids("f1")
    # By hand: f0 rows [a b] [c] repeated as rows 1, 0, 1; f1 rows [] [d] [e f g] as rows 2, 2, 1.
    assert kjt.lengths().tolist() == [1, 2, 1, 3, 3, 1]
    expected_ids = torch.cat([ids0[2:3], ids0[0:2], ids0[2:3], ids1[1:4], ids1[1:4], ids1[0:1]])
    assert torch.equal(kjt.values(), expected_ids)
    w0, w1 = batch.weights("f0"), batch.weights("f1")
    assert torch.equal(kjt.weights(), torch.cat([w0[2:3], w0[0:2], w0[2:3], w1[1:4], w1[1:4], w1[0:1]]))
    assert kjt.stride() == 3


def test_vbe_route_inputs_carry_the_inverse_indices_and_per_feature_batch_sizes() -> None:
    batch = SparseBatch(keys=("f0", "f1"), lengths=((2, 1), (1, 1)), id_bounds=(9, 9), seed=5)
    rank_batch = RankBatch(batch, ((1, 0, 1), (0, 0, 1)))
    for route in (ROUTE_KJT, ROUTE_PARITYKIT):
        kjt = route_input(rank_batch, route, "from_jagged_offsets", CPU)
        # Marked VBE even though both features have 2 rows: torchrec then expands by inverse indices.
        assert kjt.variable_stride_per_key() and kjt.stride_per_key() == [2, 2]
        assert kjt.inverse_indices()[0] == ["f0", "f1"]
        assert kjt.inverse_indices()[1].tolist() == [[1, 0, 1], [0, 0, 1]]


def test_a_rank_batch_names_the_feature_whose_inverse_indices_are_out_of_range() -> None:
    batch = SparseBatch(keys=("f0", "f1"), lengths=((2, 1), (1,)), id_bounds=(9, 9), seed=5)
    with pytest.raises(HarnessError, match=r"feature 'f1': inverse indices \[1\] outside its batch size 1"):
        RankBatch(batch, ((0, 1), (0, 1)))
    with pytest.raises(HarnessError, match="different widths"):
        RankBatch(batch, ((0, 1), (0,)))


def test_a_bad_sharded_case_is_refused_in_the_caller_naming_what_is_at_fault() -> None:
    case = pinned_case("ebc", 2, "cpu", EBC_TABLES, TW_PLAN, "fused")
    with pytest.raises(HarnessError, match=r"table 't1'.*rank\(s\) \[2\] outside world size 2"):
        replace(case, plan={**TW_PLAN, "t1": ("table_wise", 2)})
    with pytest.raises(HarnessError, match="step 1 has batches for 1 ranks"):
        replace(case, steps=(case.steps[0], case.steps[1][:1]))
    with pytest.raises(HarnessError, match="'kjt' .* is required"):
        replace(case, routes=("td-paritykit",))


def test_torchrecs_td_route_is_not_drawn_for_weighted_or_vbe_batches() -> None:
    tables = (TableSpec("t0", 8, 4, ("f0", "f1", "f2", "f3")),)
    weighted = pinned_case("ebc", 2, "cpu", tables, {"t0": ("row_wise",)}, "fused", weighted=True)
    vbe = pinned_case("ebc", 2, "cpu", tables, {"t0": ("row_wise",)}, "fused", variable_batch=True)
    plain = pinned_case("ebc", 2, "cpu", tables, {"t0": ("row_wise",)}, "fused")
    assert ROUTE_TORCHREC not in weighted.routes and ROUTE_TORCHREC not in vbe.routes
    assert plain.routes == (ROUTE_KJT, ROUTE_PARITYKIT, ROUTE_TORCHREC)


# ---------------------------------------------------------------- three-way parity on two ranks


@pytest.mark.world_size(2)
@pytest.mark.parametrize("index", range(6))
def test_pinned_case_is_three_way_equal_on_two_ranks(rank_pool, index: int) -> None:
    case = pinned_cases(2, "cpu")[index]
    metrics = td_kjt.run_sharded_case(rank_pool, case)
    assert metrics["world_size"] == 2 and metrics["output_elements"] > 0
    # Tables are compared after each step of each route wherever the case trains.
    assert (metrics["table_elements"] > 0) == case.train


@pytest.mark.world_size(2)
@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=sharded_cases(2, "cpu"))
def test_sharded_td_equals_sharded_kjt_equals_unsharded_for_drawn_plans(rank_pool, case) -> None:
    reports = rank_pool.run(report_case_on_rank, case)
    assert [r.problems for r in reports] == [[], []]
    assert all(r.output_elements > 0 for r in reports)


# ---------------------------------------------------------------- what torchrec refuses


def feed_on_rank(case, route: str):
    """Shard the case's module and feed it step 0 by ``route``."""
    import torch.distributed as dist

    module = shard_case(case, CPU)
    return module(route_input(case.steps[0][dist.get_rank()], route, case.form, CPU)).wait().values()


def feed_vbe_without_inverse_indices_on_rank(case):
    import torch.distributed as dist

    module = shard_case(case, CPU)
    return module(case.steps[0][dist.get_rank()].batch.to_kjt()).wait().values()


def feed_weighted_td_on_rank(case):
    import torch.distributed as dist

    module = shard_case(case, CPU)
    return module(case.steps[0][dist.get_rank()].batch.to_td()).wait().values()




@pytest.mark.world_size(2)
def test_refusal_sharded_ebc_takes_no_weighted_tensordict_through_torchrecs_route(rank_pool) -> None:
    case = pinned_case("ebc", 2, "cpu", EBC_TABLES, TW_PLAN, "fused", weighted=True)
    with pytest.raises(RankFailure, match="AttributeError.*_values"):
        rank_pool.run(feed_weighted_td_on_rank, case)


@pytest.mark.world_size(2)
def test_refusal_sharded_ebc_takes_no_vbe_batch_without_inverse_indices(rank_pool) -> None:
    case = pinned_case("ebc", 2, "cpu", EBC_TABLES, TW_PLAN, "fused", variable_batch=True)
    with pytest.raises(RankFailure, match="inverse indices must be provided"):
        rank_pool.run(feed_vbe_without_inverse_indices_on_rank, case)


@pytest.mark.world_size(2)
def test_refusal_sharded_ebc_takes_no_vbe_batch_after_a_fixed_batch(rank_pool) -> None:
    fixed = pinned_case("ebc", 2, "cpu", EBC_TABLES, TW_PLAN, "fused")
    vbe = pinned_case("ebc", 2, "cpu", EBC_TABLES, TW_PLAN, "fused", variable_batch=True)
    with pytest.raises(RankFailure, match="variable batch dist is not initialized"):
        rank_pool.run(feed_fixed_then_vbe_on_rank, fixed, vbe)


def feed_fixed_then_vbe_on_rank(fixed, vbe):
    import torch.distributed as dist

    rank = dist.get_rank()
    module = shard_case(fixed, CPU)
    module(route_input(fixed.steps[0][rank], ROUTE_KJT, fixed.form, CPU)).wait()
    module(route_input(vbe.steps[0][rank], ROUTE_KJT, vbe.form, CPU)).wait()


@pytest.mark.world_size(2)
def test_refusal_sharded_ec_offers_no_table_row_wise(rank_pool) -> None:
    tables = (TableSpec("t0", 8, 4, ("f0", "f1", "f2", "f3")),)
    case = pinned_case("ec", 2, "cpu", tables, {"t0": ("table_row_wise", 0)}, "fused")
    with pytest.raises(RankFailure, match="Sharding not supported table_row_wise"):
        rank_pool.run(feed_on_rank, case, ROUTE_KJT)


# ---------------------------------------------------------------- known broken inside torchrec


@pytest.mark.world_size(2)
def test_known_broken_a_kjt_fed_after_a_tensordict_is_looked_up_unpermuted(rank_pool) -> None:
    case = kjt_after_td_case(2, "cpu")
    with pytest.raises(ParityError) as raised:
        td_kjt.run_kjt_after_td(rank_pool, case)
    message = str(raised.value)
    # The first KJT and the TensorDict are right; only the KJT after the TensorDict differs.
    assert "feeding 3 (kjt)" in message
    assert "feeding 1" not in message and "feeding 2" not in message


@pytest.mark.world_size(2)
def test_known_broken_a_row_wise_mean_table_averages_the_other_tables_again(rank_pool) -> None:
    reports = rank_pool.run(report_case_on_rank, rw_mean_beside_others_case(2, "cpu"))
    problems = [text for report in reports for kind, text in report.problems if kind == VS_UNSHARDED]
    # t1 (table-wise SUM, f2) and t2 (column-wise MEAN, f3) differ; t0 (row-wise MEAN) does not.
    assert any("output['f2']" in text for text in problems) and any("output['f3']" in text for text in problems)
    assert not any("output['f0']" in text or "output['f1']" in text for text in problems)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("label", ["vbe-dense-kernel", "vbe-mixed-pooling", "vbe-data-parallel", "vbe-training-ec",
                                   "vbe-training-row-wise", "vbe-training-table-row-wise", "vbe-row-mean-reordered"])
def test_known_broken_vbe_case_fails_inside_torchrec(rank_pool, label: str) -> None:
    cases = dict(vbe_broken_cases(2, "cpu"))
    with pytest.raises((ParityError, RankFailure)):
        td_kjt.run_sharded_case(rank_pool, cases[label])


def test_known_broken_results_are_marked_by_matching_known_issues(rank_pools) -> None:
    config = GateConfig(world_sizes=(1,), examples=1)
    results = td_kjt.known_broken_results(rank_pools, config)
    labels = {r.case_id.split(":")[0].removeprefix("known-broken ") for r in results}
    assert KJT_AFTER_TD in labels and "vbe-training-ec" in labels
    assert all(r.status == "fail" for r in results)
    issues = [KnownIssue(check="td-kjt", case=f"known-broken {label}: *", reason=label) for label in labels]
    judged = apply(results, issues, {})
    assert {r.status for r in judged.cases} == {"known-issue"} and judged.stale == []


# ---------------------------------------------------------------- a 1e-3 drift fails


def drifted_report_on_rank(case, what: str):
    """The case with one path's numbers scaled by 1 + 1e-3: the sharded outputs, or one gathered table."""
    from paritykit.checks.td_kjt import rank as rank_module
    from paritykit.harness.patching import replaced

    def scale_outputs(original):
        def outputs_by_key(kind, output):
            return {key: value * (1 + 1e-3) for key, value in original(kind, output).items()}
        return outputs_by_key

    def scale_table(original):
        def gather(module):
            tables = original(module)
            first = min(tables)
            return {**tables, first: tables[first] * (1 + 1e-3)}
        return gather

    name, make = ("outputs_by_key", scale_outputs) if what == "outputs" else ("gather_full_weights", scale_table)
    with replaced(rank_module, name, make):
        return rank_module.report_case_on_rank(case)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("what", ["outputs", "table"])
def test_a_consistent_1e_3_drift_of_the_sharded_numbers_fails_the_bound(rank_pool, what: str) -> None:
    # Row-wise MEAN and table-row-wise SUM: the loosest bound the check derives (summation order + eps).
    case = pinned_cases(2, "cpu")[2]
    assert case.plan["t1"] == ("table_row_wise", 0) and case.tables[0].pooling == "MEAN"
    assert rank_pool.run(report_case_on_rank, case)[0].problems == []
    reports = rank_pool.run(drifted_report_on_rank, case, what)
    kinds = [kind for report in reports for kind, _ in report.problems]
    assert VS_UNSHARDED in kinds
    # The drift is the same on every route: the old TD-vs-KJT comparison cannot see it.
    assert TD_VS_KJT not in kinds


def plan_kernels_on_rank(case):
    return {table: sharding.compute_kernel for table, sharding in shard_case(case, CPU).module_sharding_plan.items()}


@pytest.mark.world_size(2)
def test_table_row_wise_tables_are_sharded_with_the_cases_kernel(rank_pool) -> None:
    case = pinned_cases(2, "cpu")[2]
    assert case.plan["t1"] == ("table_row_wise", 0) and case.kernel == "fused"
    assert rank_pool.run(plan_kernels_on_rank, case) == [{"t0": "fused", "t1": "fused", "t2": "fused"}] * 2


def test_on_cpu_every_row_sharded_table_gets_rows_on_every_rank_and_other_tables_keep_theirs():
    # fbgemm's CPU kernel refuses an empty row-wise shard (the sharding check runs that known issue on
    # purpose): at world size 10 an 8-row row-wise table would leave two ranks without rows.
    tables = (TableSpec("t0", 8, 4, ("f0",)), TableSpec("t1", 6, 4, ("f1",)), TableSpec("t2", 7, 4, ("f2", "f3")))
    plan = {"t0": ("row_wise",), "t1": ("table_row_wise", 0), "t2": ("table_wise", 3)}
    on_cpu = pinned_case("ebc", 10, "cpu", tables, plan, "fused")
    assert [t.num_embeddings for t in on_cpu.tables] == [10, 10, 7]
    assert "t0[10x4 f0 SUM]" in on_cpu.describe()
    on_cuda = pinned_case("ebc", 10, "cuda", tables, plan, "fused")
    assert [t.num_embeddings for t in on_cuda.tables] == [8, 6, 7]  # GPU kernels take empty shards
