"""The td-kjt check: TensorDict vs KJT through EBC/EC, eager and sharded, and its negative controls."""

from __future__ import annotations

import pytest
from hypothesis import given

from paritykit.checks.runner import GateConfig
from paritykit.checks.td_kjt import cases as td_kjt
from paritykit.checks.td_kjt.assertion import assert_td_kjt_parity
from paritykit.errors import ParityError
from paritykit.harness import plants
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
    with plants.applied([plant]), pytest.raises(ParityError, match="outputs"):
        assert_td_kjt_parity(module, DISTINCT)


# ---------------------------------------------------------------- the gate entry point
# The sharded three-way parity, its refusals and known-broken cases: tests/test_td_kjt_sharded.py;
# its planted bugs: tests/test_td_kjt_plants.py; its tolerances: tests/test_td_kjt_tolerances.py.


@pytest.mark.slow
def test_gate_run_passes_except_the_known_broken_cases_and_fails_under_a_plant(rank_pools) -> None:
    config = GateConfig(world_sizes=(2,), examples=4, seed=3)
    results = td_kjt.run_matrix(config, rank_pools)
    statuses = {r.status for r in results if not r.case_id.startswith("known-broken")}
    assert statuses == {"pass"}
    assert sum(r.case_id.startswith("sharded ") for r in results) >= 4
    with plants.applied(["offsets-off-by-one"]):
        failing = td_kjt.run_matrix(GateConfig(world_sizes=(), examples=20, seed=3), rank_pools)
    assert any(r.status == "fail" and "outputs" in r.message for r in failing)
