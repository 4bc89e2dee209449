"""The sharded td-kjt bounds, derived from the case: the numbers each comparison uses, computed here by
hand, and a consistent 1e-3 relative drift failing each of them (no ranks needed)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from paritykit.checks.td_kjt.pinned import pinned_case
from paritykit.checks.td_kjt.sharded_spec import RankBatch, ShardedCase
from paritykit.checks.td_kjt.tolerances import (
    MEAN_DIVISOR_EPS,
    UPSTREAM_BOUND,
    id_occurrences,
    output_tolerances,
    table_tolerances,
)
from paritykit.compare import find_differences
from paritykit.harness.tables import TableSpec, seeded_full_weights
from paritykit.strategies import SparseBatch

U = 2.0**-24  # float32 unit roundoff


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def vbe_case(weighted: bool, pooling: str = "SUM", placement: tuple = ("table_wise", 0)):
    tables = (TableSpec("t0", 8, 4, ("f0", "f1"), pooling), TableSpec("t1", 6, 4, ("f2", "f3"), pooling))
    return pinned_case("ebc", 2, "cpu", tables, {"t0": placement, "t1": ("table_wise", 1)}, "fused",
                       weighted=weighted, variable_batch=True, seed=7)


def test_ebc_output_bound_is_the_summation_bound_of_the_longest_bag_and_largest_term() -> None:
    case = vbe_case(weighted=True)
    rank_batch = case.steps[0][0]
    full = seeded_full_weights(case.tables, case.seed)
    tolerances = output_tolerances(case, rank_batch, full)
    batch = rank_batch.batch
    for k, key in enumerate(batch.keys):
        table = "t0" if key in ("f0", "f1") else "t1"
        n = max(batch.lengths[k])
        weights = batch.weights(key)
        per_id = float(weights.max()) if weights.numel() else 1.0  # weights lie in [0, 1)
        magnitude = float(full[table].abs().max()) * per_id
        assert tolerances[key].terms == n
        assert tolerances[key].magnitude == pytest.approx(magnitude)
        assert tolerances[key].atol == pytest.approx(2 * gamma(n) * n * magnitude)
        assert tolerances[key].rtol == 4 * U


def test_ec_outputs_are_compared_bit_exact() -> None:
    tables = (TableSpec("t0", 8, 8, ("f0", "f1", "f2", "f3")),)
    case = pinned_case("ec", 2, "cpu", tables, {"t0": ("row_wise",)}, "fused")
    assert set(output_tolerances(case, case.steps[0][0], seeded_full_weights(tables, 0)).values()) == {None}


def test_row_sharded_mean_adds_torchrecs_divisor_eps_to_row_sharded_tables_only() -> None:
    tables = (TableSpec("t0", 8, 4, ("f0", "f1"), "MEAN"), TableSpec("t1", 6, 4, ("f2", "f3")))
    case = pinned_case("ebc", 2, "cpu", tables, {"t0": ("row_wise",), "t1": ("table_row_wise", 0)}, "fused")
    out = output_tolerances(case, case.steps[0][0], seeded_full_weights(tables, 0))
    # t1 pools with SUM but is row-sharded: torchrec divides it by (1 + eps) too.
    assert all(out[key].rtol == 4 * U + MEAN_DIVISOR_EPS for key in ("f0", "f1", "f2", "f3"))
    plain = vbe_case(weighted=False, pooling="MEAN")
    assert all(t.rtol == 4 * U for t in output_tolerances(plain, plain.steps[0][0], seeded_full_weights(plain.tables, 7)).values())


def test_id_occurrences_count_every_repeat_of_a_row_by_the_inverse_indices() -> None:
    # One rank, feature f0 of table t0: rows [3, 3] and [5]; the output repeats row 0 twice and row 1 once.
    batch = SparseBatch(keys=("f0",), lengths=((2, 1),), id_bounds=(8,), seed=0)
    ids = batch.ids("f0").tolist()
    rank_batch = RankBatch(batch, ((0, 1, 0),))
    tables = (TableSpec("t0", 8, 4, ("f0",)),)
    case = ShardedCase("ebc", 1, tables, {"t0": ("table_wise", 0)}, "fused", ("kjt",), "nested_tensor", ((rank_batch,),), "cpu")
    expected = Counter()
    for repeat in (0, 1, 0):
        for i in (ids[0:2] if repeat == 0 else ids[2:3]):
            expected[i] += 1
    assert id_occurrences(case, 0, "t0") == expected


def test_table_bound_is_lr_times_scale_times_the_gradient_sum_bound() -> None:
    case = vbe_case(weighted=False)
    tolerances = table_tolerances(case, 0, learning_rate=0.1, gradient_division=True)
    for table in ("t0", "t1"):
        n = max(id_occurrences(case, 0, table).values())
        magnitude = UPSTREAM_BOUND
        expected = 0.1 * 0.5 * (2 * gamma(n) * n * magnitude + 4 * U * n * magnitude)
        assert tolerances[table].terms == n
        assert tolerances[table].atol == pytest.approx(expected)
    undivided = table_tolerances(case, 0, learning_rate=0.1, gradient_division=False)
    assert undivided["t0"].atol == pytest.approx(2 * tolerances["t0"].atol)


@pytest.mark.parametrize("weighted", [False, True])
def test_a_consistent_1e_3_relative_drift_fails_every_derived_bound(weighted: bool) -> None:
    case = vbe_case(weighted=weighted)
    full = seeded_full_weights(case.tables, case.seed)
    pooled = {key: torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i, key in enumerate(case.keys)}
    for key, tolerance in output_tolerances(case, case.steps[0][0], full).items():
        same = find_differences(pooled[key], pooled[key].clone(), rtol=tolerance.rtol, atol=tolerance.atol)
        drifted = find_differences(pooled[key] * (1 + 1e-3), pooled[key], rtol=tolerance.rtol, atol=tolerance.atol)
        assert not same and drifted, key
    for table, tolerance in table_tolerances(case, 0, 0.1, True).items():
        drifted = find_differences(full[table] * (1 + 1e-3), full[table], rtol=tolerance.rtol, atol=tolerance.atol)
        assert drifted, table
