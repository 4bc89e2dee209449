"""Every planted bug of the DMP and collectives cases: first shown to move torchrec's own numbers (the
sharded model with and without the plant, no paritykit oracle involved), then caught by its case."""

from __future__ import annotations

import pytest

from paritykit.checks.sharding import dmp_plants
from paritykit.checks.sharding.collective_cases import CollectiveCase, run_collective_case, run_collectives_on_rank
from paritykit.checks.sharding.dmp_cases import DmpCase, dmp_cases, dmp_setup, run_dmp_case
from paritykit.compare import find_differences
from paritykit.engine.training import TrainingRecord, assemble_records, train_on_rank
from paritykit.errors import ParityError
from paritykit.harness import plants


def case_named(name: str, nth: int = 0) -> DmpCase:
    return [case for case in dmp_cases(2) if case.name == name][nth]


PLANT_CASES = {
    "sync-all-to-all-backward-not-divided": lambda: case_named("sync-collectives", 0),
    "pooled-all-to-all-divides-with-division-off": lambda: case_named("no-gradient-division", 0),
    "fused-hyper-parameters-skip-an-optimizer": lambda: case_named("hyper-parameter-schedule", 0),
    "reshard-drops-optimizer-state": lambda: case_named("reshard"),
    "qcomm-backward-loss-scale-not-undone": lambda: case_named("qcomm-fp16", 0),
    "sharded-embedding-bag-drops-weights": lambda: case_named("embedding-bag", 0),
    "bare-named-parameters-only-sharded": lambda: case_named("meta-init"),
}
# Plants in a collective alone: caught by its collectives case (no sharded model around it).
COLLECTIVE_PLANTS = {"all-gather-backward-not-divided": CollectiveCase(2, sync=False, division=True)}


def sharded_run(pool, case: DmpCase) -> TrainingRecord:
    return assemble_records(pool.call(train_on_rank, (dmp_setup(case),)))


def moved(clean: TrainingRecord, planted: TrainingRecord) -> list:
    pairs = [(planted.embeddings, clean.embeddings), (planted.outputs, clean.outputs), (planted.state, clean.state)]
    return [d for a, e in pairs for d in find_differences(a, e, exact=True)]


def test_every_dmp_plant_has_a_case():
    registered = {name for name, plant in plants.PLANTS.items() if plant.module == dmp_plants.__name__}
    assert registered == set(PLANT_CASES) | set(COLLECTIVE_PLANTS)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(PLANT_CASES))
def test_the_plant_moves_torchrecs_numbers_and_its_case_catches_it(rank_pool, plant):
    case = PLANT_CASES[plant]()
    clean = sharded_run(rank_pool, case)
    with plants.applied([plant]):
        assert moved(clean, sharded_run(rank_pool, case)), f"{plant} leaves the sharded numbers unchanged"
        with pytest.raises(ParityError, match="differs from the unsharded reference"):
            run_dmp_case(case, rank_pool)
    assert run_dmp_case(case, rank_pool)["steps"] == 3


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(COLLECTIVE_PLANTS))
def test_a_collective_plant_moves_torchrecs_gradients_and_its_collectives_case_catches_it(rank_pool, plant):
    case = COLLECTIVE_PLANTS[plant]
    clean = rank_pool.call(run_collectives_on_rank, (case,))
    with plants.applied([plant]):
        planted = rank_pool.call(run_collectives_on_rank, (case,))
        assert find_differences(planted, clean, exact=True), f"{plant} leaves torchrec's collectives unchanged"
        with pytest.raises(ParityError, match="is not what the collective means"):
            run_collective_case(case, rank_pool)
    assert run_collective_case(case, rank_pool)["operations"] == 3
