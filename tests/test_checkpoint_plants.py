"""Every planted bug of the checkpoint check: first shown to move torchrec's own numbers (the resumed
model with and without the plant, no paritykit oracle involved), then caught by the check."""

from __future__ import annotations

import pytest

from paritykit.checks.checkpoint.cases import case_setup
from paritykit.checks.checkpoint.matrix import run_case
from paritykit.checks.checkpoint.pinned import pinned_cases
from paritykit.compare import find_differences
from paritykit.engine.checkpoint_roundtrip import run_phases
from paritykit.errors import ParityError
from paritykit.harness import plants

# plant -> (pinned case index, what the check names)
PLANT_CASES = {
    "fused-optimizer-load-drops-momentum": (2, "the fused optimizer's state differs from the saved one"),
    "sharded-load-ignores-shard-offsets": (1, r"the model's state \(tables gathered from the shards, dense parameters\) differs"),
    "post-load-state-dict-not-called": (3, "the learning rate of the next step differs"),
}


def resumed(case, pools):
    return run_phases(case_setup(case), pools.get, "plant")[1]


def moved(clean, planted) -> list:
    a, b = planted.restored, clean.restored
    pairs = [(a.state, b.state), (a.fused_state, b.fused_state), (a.dense_state, b.dense_state),
             (a.learning_rates, b.learning_rates), (planted.steps.state, clean.steps.state)]
    return [d for x, y in pairs for d in find_differences(x, y, exact=True)]


def test_every_checkpoint_plant_has_a_case():
    assert {name for name, plant in plants.PLANTS.items() if plant.check == "checkpoint"} == set(PLANT_CASES)


@pytest.mark.parametrize("plant", sorted(PLANT_CASES))
def test_the_plant_moves_torchrecs_numbers_and_the_check_catches_it(rank_pools, plant):
    index, named = PLANT_CASES[plant]
    case = pinned_cases(2)[index]
    clean = resumed(case, rank_pools)
    with plants.applied([plant]):
        assert moved(clean, resumed(case, rank_pools)), f"{plant} leaves the resumed numbers unchanged"
        with pytest.raises(ParityError, match=named):
            run_case(case, rank_pools)
    # The clean case passes: the gate-entry test (test_checkpoint_roundtrips.py) runs every pinned one.
