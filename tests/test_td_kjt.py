"""The td-kjt check: TensorDict vs KJT through EBC/EC, eager and sharded, and its negative controls."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from paritykit.harness import plants
from paritykit.checks.runner import GateConfig
from paritykit.checks.td_kjt import cases as td_kjt
from paritykit.checks.td_kjt.assertion import ROUTES, assert_td_kjt_parity
from paritykit.checks.td_kjt.cases import ShardedCase, run_sharded_case
from paritykit.gate.gating import run_checks
from paritykit.errors import ParityError
from paritykit.harness.tables import TableSpec, build_ebc, build_ec
from paritykit.strategies import SparseBatch, jagged_forms, sparse_batches

KEYS = ("f0", "f1", "f2")


def tables(pooling: str = "SUM") -> tuple[TableSpec, ...]:
    return (
        TableSpec("t0", num_embeddings=20, embedding_dim=4, feature_names=("f0", "f1"), pooling=pooling),
        TableSpec("t1", num_embeddings=20, embedding_dim=4, feature_names=("f2",), pooling=pooling),
    )


def batches(**kwargs):
    return sparse_batches(keys=list(KEYS), id_bounds=20, **kwargs)


# A batch where every plant changes the answer: several rows, all features non-empty and different.
DISTINCT = SparseBatch(keys=KEYS, lengths=((2, 1, 3), (1, 2, 1), (3, 1, 2)), id_bounds=(20, 20, 20), seed=11, weighted=True)


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
@given(batch=batches(variable_batch=False), form=jagged_forms())
def test_ebc_fed_a_td_via_paritykit_matches_the_kjt(pooling: str, batch: SparseBatch, form: str) -> None:
    # torch's embedding_bag takes per-sample weights only with SUM pooling.
    pooling = "SUM" if batch.weighted else pooling
    module = build_ebc(tables(pooling), seed=0, is_weighted=batch.weighted)
    metrics = assert_td_kjt_parity(module, batch, form=form, route="paritykit")
    assert metrics["gradient_elements"] == 20 * 4 * 2


@given(batch=batches(weighted=False, variable_batch=False), form=jagged_forms(contiguous_only=True))
def test_ebc_fed_a_td_via_torchrec_matches_the_kjt_where_torchrec_is_defined(batch: SparseBatch, form: str) -> None:
    assert_td_kjt_parity(build_ebc(tables("MEAN"), seed=1), batch, form=form, route="torchrec")


@given(batch=batches(weighted=False), form=jagged_forms())
def test_ec_fed_a_td_via_paritykit_matches_the_kjt_including_variable_batch(batch: SparseBatch, form: str) -> None:
    assert_td_kjt_parity(build_ec(tables(), seed=2), batch, form=form, route="paritykit")


def test_shortfall_weighted_ebc_cannot_take_torchrecs_td_route() -> None:
    module = build_ebc(tables(), seed=0, is_weighted=True)
    with pytest.raises(ParityError, match="TensorDict form raised AttributeError.*_values"):
        assert_td_kjt_parity(module, DISTINCT, route="torchrec")


def test_parity_accepts_a_kjt_or_a_td_as_the_batch() -> None:
    module = build_ebc(tables(), seed=0, is_weighted=True)
    assert_td_kjt_parity(module, DISTINCT.to_kjt())
    assert_td_kjt_parity(module, DISTINCT.to_td("narrow"))


# ---------------------------------------------------------------- negative controls


@pytest.mark.parametrize("plant", ["offsets-off-by-one", "feature-key-swap", "weights-dropped"])
def test_planted_conversion_bug_is_caught_eagerly(plant: str) -> None:
    module = build_ebc(tables(), seed=0, is_weighted=True)
    assert_td_kjt_parity(module, DISTINCT)  # the same case passes without the plant
    with plants.applied([plant]):
        with pytest.raises(ParityError, match="outputs"):
            assert_td_kjt_parity(module, DISTINCT)


# ---------------------------------------------------------------- sharded, on the rank pool


def sharded_case(sharding: str, kernel: str, route: str, module: str = "ebc", weighted: bool = False) -> ShardedCase:
    rows = ((2, 0, 1), (1, 3, 1), (0, 2, 2))
    batch_of_rank = [
        SparseBatch(keys=KEYS, lengths=rows[r:] + rows[:r], id_bounds=(20, 20, 20), seed=r, weighted=weighted)
        for r in range(2)
    ]
    return ShardedCase(module, sharding, kernel, route, "SUM", tuple(batch_of_rank))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sharding", td_kjt.SHARDINGS)
@pytest.mark.parametrize("route", ROUTES)
def test_sharded_ebc_fed_a_td_matches_the_kjt(rank_pool, sharding: str, route: str) -> None:
    kernel = "dense" if sharding in ("data_parallel", "table_row_wise") else "fused"
    metrics = run_sharded_case(rank_pool, sharded_case(sharding, kernel, route, weighted=route == "paritykit"))
    assert metrics["world_size"] == 2 and metrics["output_elements"] > 0


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_sharded_ec_fed_a_td_via_paritykit_matches_the_kjt(rank_pool, sharding: str) -> None:
    metrics = run_sharded_case(rank_pool, sharded_case(sharding, "fused", "paritykit", module="ec"))
    assert metrics["output_elements"] > 0


@pytest.mark.world_size(2)
def test_planted_key_swap_is_caught_on_every_rank(rank_pool) -> None:
    case = sharded_case("table_wise", "fused", "paritykit")
    with plants.applied(["feature-key-swap"]):
        with pytest.raises(ParityError, match="rank 0 .*outputs"):
            run_sharded_case(rank_pool, case)


# ---------------------------------------------------------------- the gate entry point


@pytest.mark.slow
def test_gate_run_passes_and_fails_under_a_plant(rank_pools) -> None:
    config = GateConfig(world_sizes=(2,), examples=4, seed=3)
    results, _ = run_checks(["td-kjt"], config, rank_pools)
    assert {r.status for r in results} == {"pass"}
    with plants.applied(["offsets-off-by-one"]):
        failing = td_kjt.run_matrix(GateConfig(world_sizes=(), examples=20, seed=3), rank_pools)
    assert any(r.status == "fail" and "outputs" in r.message for r in failing)
