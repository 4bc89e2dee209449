"""paritykit.models: specs, plans, inputs, and weights in and out of shards on real ranks."""

from __future__ import annotations

import pytest
import torch

from paritykit.errors import HarnessError
from paritykit.harness.plans import compute_kernels, describe_plan, validate_plan
from paritykit.harness.sharded import copy_full_weights_into, gather_full_weights, shard_module
from paritykit.harness.tables import (
    TableSpec,
    build_ebc,
    build_ec,
    feature_names_of,
    kjt_from_rows,
    seeded_full_weights,
    unsharded_full_weights,
)

TABLES = (
    TableSpec("t0", 10, 12, ("f0",)),
    TableSpec("t1", 7, 12, ("f1", "f0")),
    TableSpec("t2", 9, 12, ("f2",)),
    TableSpec("t3", 6, 12, ("f3",)),
)


def test_table_spec_rejects_bad_tables_by_name():
    with pytest.raises(ValueError, match="table 'x' has no feature names"):
        TableSpec("x", 4, 4, ())
    with pytest.raises(ValueError, match="table 'y': pooling must be one of"):
        TableSpec("y", 4, 4, ("f",), pooling="MAX")


def test_seeded_weights_are_deterministic_per_seed_and_table():
    a, b, c = seeded_full_weights(TABLES, 1), seeded_full_weights(TABLES, 1), seeded_full_weights(TABLES, 2)
    assert all(torch.equal(a[t], b[t]) for t in a)
    assert not any(torch.equal(a[t], c[t]) for t in a)
    # A table's weight does not depend on which other tables are in the spec.
    assert torch.equal(seeded_full_weights(TABLES[1:2], 1)["t1"], a["t1"])


@pytest.mark.parametrize("build", [build_ec, build_ebc])
def test_built_modules_hold_the_seeded_weights(build):
    module = build(TABLES, seed=3)
    expected = seeded_full_weights(TABLES, 3)
    loaded = unsharded_full_weights(module)
    assert sorted(loaded) == sorted(expected)
    assert all(torch.equal(loaded[t], expected[t]) for t in expected)


def test_feature_names_keep_first_seen_order_without_repeats():
    assert feature_names_of(TABLES) == ("f0", "f1", "f2", "f3")


def test_validate_plan_names_the_table_or_rank_at_fault():
    good = {"t0": ("column_wise", [0, 1, 0]), "t1": ("table_wise", 1), "t2": "row_wise", "t3": ("data_parallel",)}
    assert validate_plan(TABLES, good, 2)["t0"] == ("column_wise", (0, 1, 0))
    with pytest.raises(HarnessError, match=r"missing \['t3'\]"):
        validate_plan(TABLES, {k: v for k, v in good.items() if k != "t3"}, 2)
    with pytest.raises(HarnessError, match=r"table 't1': rank\(s\) \[2\] outside world size 2"):
        validate_plan(TABLES, {**good, "t1": ("table_wise", 2)}, 2)
    with pytest.raises(HarnessError, match="table 't0': embedding_dim 12 is not divisible into 5"):
        validate_plan(TABLES, {**good, "t0": ("column_wise", [0, 1, 0, 1, 0])}, 2)
    with pytest.raises(HarnessError, match=r"plan entry for table 't2' is \('diagonal',\)"):
        validate_plan(TABLES, {**good, "t2": ("diagonal",)}, 2)


def test_describe_plan_is_compact():
    assert describe_plan({"t0": ("column_wise", (0, 1, 0)), "t1": ("table_wise", 1), "t2": ("row_wise",)}) == (
        "{'t0': column_wise(0,1,0), 't1': table_wise(1), 't2': row_wise()}"
    )


def test_kjt_from_rows_lays_out_values_and_lengths_key_by_key():
    kjt = kjt_from_rows(("a", "b"), {"a": [[1, 2], []], "b": [[], [3]]}, {"a": [[0.5, 1.5], []], "b": [[], [2.0]]})
    assert kjt.keys() == ["a", "b"]
    assert kjt.values().tolist() == [1, 2, 3]
    assert kjt.lengths().tolist() == [2, 0, 0, 1]
    assert kjt.weights().tolist() == [0.5, 1.5, 2.0]
    with pytest.raises(HarnessError, match="different batch sizes"):
        kjt_from_rows(("a", "b"), {"a": [[1]], "b": [[], []]})
    with pytest.raises(HarnessError, match=r"feature 'a' row 0: 1 weights for 2 ids"):
        kjt_from_rows(("a",), {"a": [[1, 2]]}, {"a": [[1.0]]})


def test_compute_kernels_on_cpu():
    assert compute_kernels("cpu", "data_parallel") == ("dense",)
    assert compute_kernels("cpu", "column_wise", module_kind="ec") == ("dense", "fused")
    assert "fused_uvm_caching" in compute_kernels("cuda", "row_wise", module_kind="ebc")


def test_shard_module_outside_a_process_group_is_a_harness_error():
    with pytest.raises(HarnessError, match="process group"):
        shard_module(build_ec(TABLES, seed=0), {t.name: ("row_wise",) for t in TABLES})


EC_PLAN = {"t0": ("column_wise", (1, 0, 0)), "t1": ("table_wise", 1), "t2": ("row_wise",), "t3": ("column_wise", (0, 1, 1))}
EBC_PLAN = {"t0": ("column_wise", (1, 0, 0)), "t1": ("table_row_wise", 0), "t2": ("row_wise",), "t3": ("data_parallel",)}


def copy_then_gather_on_rank(module_kind: str, plan: dict, kernel: str) -> dict[str, torch.Tensor]:
    build = build_ec if module_kind == "ec" else build_ebc
    sharded = shard_module(build(TABLES, seed=100), plan, compute_kernel=kernel)
    copy_full_weights_into(sharded, seeded_full_weights(TABLES, 7))
    return gather_full_weights(sharded)


@pytest.mark.parametrize(
    "module_kind, plan, kernel", [("ec", EC_PLAN, "fused"), ("ebc", EBC_PLAN, "fused"), ("ebc", EBC_PLAN, "dense")]
)
def test_copy_then_gather_round_trips_every_sharding_type(rank_pool, module_kind, plan, kernel):
    expected = seeded_full_weights(TABLES, 7)
    per_rank = rank_pool.run(copy_then_gather_on_rank, module_kind, plan, kernel)
    for gathered in per_rank:
        assert sorted(gathered) == sorted(expected)
        for table in expected:
            assert torch.equal(gathered[table], expected[table]), table


def gather_without_copy_on_rank() -> dict[str, torch.Tensor]:
    # A sharded EC starts from the unsharded module's weights (torchrec loads them itself).
    return gather_full_weights(shard_module(build_ec(TABLES, seed=5), EC_PLAN, compute_kernel="fused"))


def test_gather_returns_the_weights_the_module_was_sharded_with(rank_pool):
    expected = seeded_full_weights(TABLES, 5)
    gathered = rank_pool.run(gather_without_copy_on_rank)[1]
    assert all(torch.equal(gathered[t], expected[t]) for t in expected)


def copy_wrong_shape_on_rank() -> str:
    sharded = shard_module(build_ec(TABLES, seed=0), EC_PLAN, compute_kernel="fused")
    weights = seeded_full_weights(TABLES, 0)
    weights["t2"] = weights["t2"][:3]
    try:
        copy_full_weights_into(sharded, weights)
    except HarnessError as exc:
        return str(exc)
    return "no error"


def test_copy_rejects_a_full_weight_of_the_wrong_shape_naming_the_table(rank_pool):
    messages = rank_pool.run(copy_wrong_shape_on_rank)
    assert messages == ["table 't2': full weight has shape (3, 12), the module expects (9, 12)"] * 2
