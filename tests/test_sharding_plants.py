"""Every planted bug of the sharding check: first shown to move torchrec's own numbers (the sharded
model with and without the plant, no paritykit oracle involved), then caught by the check."""

from __future__ import annotations

import dataclasses

import pytest

from paritykit.checks.sharding.case_runner import case_setup, run_sharding_case
from paritykit.checks.sharding.cases import ShardingCase
from paritykit.checks.sharding.optimizer_draws import optimizer_pinned_cases
from paritykit.checks.sharding.pinned import pinned_cases
from paritykit.engine.training import TrainingRecord, assemble_records, train_on_rank
from paritykit.compare import find_differences
from paritykit.errors import ParityError
from paritykit.harness import plants
from paritykit.harness.tables import TableSpec


def pinned(index: int) -> ShardingCase:
    return pinned_cases(2)[index]


def sgd_table_wise() -> ShardingCase:
    # Adagrad is blind to a constant gradient scale, so a lost gradient division needs SGD to show.
    case = pinned(2)
    tables = tuple(dataclasses.replace(t, pooling="SUM") for t in case.tables)
    return dataclasses.replace(case, tables=tables, plan={"t0": ("table_wise", 1), "t1": ("column_wise", (0, 1, 0)), "t2": ("table_wise", 0)},
                               optimizer="sgd")


PLANT_CASES = {
    "cw-permute-rank-order": lambda: pinned(0),
    "cw-permute-inverted": lambda: pinned(1),
    "wrong-pooling-mode": lambda: pinned(2),
    "pooled-all-to-all-backward-not-divided": sgd_table_wise,
    "row-wise-bucketize-block-off-by-one": lambda: pinned(4),
    "row-wise-bucketize-loses-weights": lambda: pinned(5),
    "mean-divisor-epsilon-1e-3": lambda: pinned(4),
    "sharded-ebc-output-keys-swapped": lambda: pinned(5),
    "variable-batch-inverse-indices-reversed": lambda: pinned(6),
    "fused-optimizer-learning-rate-doubled": lambda: pinned(4),
    # Counter-based weight decay (decoupled) on CW/RW shards; exact Adagrad with eps 0.1 in an EC;
    # EMA in-place row-wise Adagrad over CW and TWCW shards.
    "fused-optimizer-eps-dropped": lambda: optimizer_pinned_cases(2)[1],
    "fused-optimizer-weight-decay-dropped": lambda: optimizer_pinned_cases(2)[0],
    "fused-optimizer-weight-decay-modes-swapped": lambda: optimizer_pinned_cases(2)[0],
    "fused-optimizer-state-named-by-index": lambda: optimizer_pinned_cases(2)[0],
    "fused-optimizer-ema-mode-dropped": lambda: optimizer_pinned_cases(2)[2],
    "ebc-fused-optimizer-type-from-class": lambda: optimizer_pinned_cases(2)[2],
}


def sharded_run(pool, case: ShardingCase) -> TrainingRecord:
    return assemble_records(pool.call(train_on_rank, (case_setup(case),)))


def moved(clean: TrainingRecord, planted: TrainingRecord) -> list:
    pairs = [(planted.embeddings, clean.embeddings), (planted.outputs, clean.outputs), (planted.state, clean.state),
             (planted.fused_state, clean.fused_state)]
    return [d for a, e in pairs for d in find_differences(a, e, exact=True)]


def test_every_sharding_plant_has_a_case():
    from test_dmp_plants import COLLECTIVE_PLANTS, PLANT_CASES as DMP_PLANT_CASES  # the DMP block's, beside its cases
    from test_sharding_hosts import CROSS_HOST_PLANT_CASES, NON_SQUARE_HOST_PLANTS  # the plants only ranks on several hosts show
    from test_plan_helpers import PLAN_PLANTS, RANK_PLANTS  # plan helpers, init bounds, the FP16 wire, the dense VBE oracle
    from test_fp_plants import PLANT_CASES as FP_PLANT_CASES  # the feature-processed EBCs'
    from test_dmp_state_plants import RESHARD_PLANTS, SURFACE_PLANTS  # DMP.reshard and the sharded state surface
    from test_towers import TOWER_PLANTS  # the tower sharding's

    registered = {name for name, plant in plants.PLANTS.items() if plant.check == "sharding"}
    assert registered == (set(PLANT_CASES) | set(CROSS_HOST_PLANT_CASES) | NON_SQUARE_HOST_PLANTS | set(DMP_PLANT_CASES) | set(COLLECTIVE_PLANTS)
                          | set(PLAN_PLANTS) | RANK_PLANTS | set(FP_PLANT_CASES) | set(RESHARD_PLANTS) | set(SURFACE_PLANTS) | TOWER_PLANTS)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(PLANT_CASES))
def test_the_plant_moves_torchrecs_numbers_and_the_check_catches_it(rank_pool, plant):
    case = PLANT_CASES[plant]()
    clean = sharded_run(rank_pool, case)
    with plants.applied([plant]):
        assert moved(clean, sharded_run(rank_pool, case)), f"{plant} leaves the sharded numbers unchanged"
        with pytest.raises(ParityError, match="differs from the unsharded reference|CW permutation"):
            run_sharding_case(case, rank_pool)
    assert run_sharding_case(case, rank_pool)["steps"] == 3


def test_tables_of_the_gradient_division_case_are_table_and_column_wise():
    case = sgd_table_wise()
    assert {entry[0] for entry in case.plan.values()} == {"table_wise", "column_wise"}
    assert all(isinstance(t, TableSpec) and t.pooling == "SUM" for t in case.tables)
