"""Every planted bug of the feature-processed EBC cases: first shown to move torchrec's own numbers (the
sharded or materialised FP-EBC with and without the plant, no paritykit oracle involved), then caught by
its case."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.sharding import fp_plants
from paritykit.checks.sharding.fp_cases import MetaJob, TABLES, fp_cases, fp_setup, meta_init_on_rank, run_fp_case
from paritykit.checks.sharding.fp_models import build_wrapped_fp_ebc
from paritykit.compare import find_differences
from paritykit.engine.training import assemble_records, train_on_rank
from paritykit.errors import ParityError
from paritykit.harness import plants


def case_of(kind: str, form: str):
    """The first pinned case of ``kind`` and ``form`` on two ranks (its plan has TW, CW and RW tables)."""
    return next(c for c in fp_cases(2) if c.kind == kind and c.form == form and not c.meta_model)


def trained(pool, case):
    record = assemble_records(pool.call(train_on_rank, (fp_setup(case),)))
    return record.embeddings, record.outputs, record.state


def sharded_from_meta(pool, case):
    setup = fp_setup(case)
    job = MetaJob(TABLES, case.form, case.seed, setup.sharding_plan, setup.full_state, setup.batches[0])
    return [{"initial": {(p.name, p.offsets): p.tensor for p in record["initial"]}, "pooled": record["pooled"]}
            for record in pool.call(meta_init_on_rank, (job,))]


def materialised(case):
    setup = fp_setup(case)
    model = build_wrapped_fp_ebc(TABLES, case.form, case.seed, device="meta", seeded=False)
    model.to_empty(device="cpu")
    model.load_state_dict(setup.full_state)
    try:
        return [{k: v.detach() for k, v in model(batch).items()} for batch in setup.batches[0]]
    except Exception as exc:  # noqa: BLE001 - torchrec 1.9 moves the stale weights to the ids' device: meta fails
        return [f"raised {type(exc).__name__}: {exc}"]


def state_keys(pool, case):
    return pool.call(_keys_on_rank, (fp_setup(case),))


def _keys_on_rank(setup):
    from paritykit.engine.training import build_model

    dmp = setup.options.sharded(lambda: build_model(setup), setup.sharding_plan, torch.device("cpu"))
    return sorted(dmp.state_dict())


# plant -> (the case that must catch it, what torchrec computes with and without it)
PLANT_CASES = {
    "sharded-fp-positions-after-row-wise-bucketing": (lambda: case_of("train", "collection"), trained),
    "sharded-fp-materialised-without-reset": (lambda: case_of("meta-init", "collection"), sharded_from_meta),
    "position-weights-stale-after-to-empty": (lambda: case_of("meta-init", "collection"), lambda _pool, case: materialised(case)),
    "sharded-fp-state-dict-drops-position-weights": (lambda: case_of("train", "dict"), state_keys),
}


def test_every_fp_plant_has_a_case():
    registered = {name for name, plant in plants.PLANTS.items() if plant.module == fp_plants.__name__}
    assert registered == set(PLANT_CASES)


def _moved(clean, planted) -> bool:
    if all(isinstance(keys, list) and all(isinstance(k, str) for k in keys) for keys in clean):
        return clean != planted  # state_dict keys per rank
    return bool(find_differences(planted, clean, exact=True))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(PLANT_CASES))
def test_the_plant_moves_torchrecs_numbers_and_its_fp_case_catches_it(rank_pool, plant):
    make_case, torchrec_numbers = PLANT_CASES[plant]
    case = make_case()
    clean = torchrec_numbers(rank_pool, case)
    with plants.applied([plant]):
        assert _moved(clean, torchrec_numbers(rank_pool, case)), f"{plant} leaves torchrec's numbers unchanged"
        # Against the unsharded FP-EBC, or first against the other ranks' replicas: a plant that leaves memory
        # uninitialised may hold NaN or differ between ranks, which the replica check reports before any step.
        with pytest.raises(ParityError, match="unsharded|differs from rank 0"):
            run_fp_case(case, rank_pool)
    assert run_fp_case(case, rank_pool)["ranks"] == 2


@pytest.mark.slow  # the same plant as above, on the other form
@pytest.mark.world_size(2)
def test_the_row_wise_plant_is_caught_in_both_forms(rank_pool):
    case = case_of("train", "dict")
    with plants.applied(["sharded-fp-positions-after-row-wise-bucketing"]):
        with pytest.raises(ParityError, match="differs from the unsharded reference"):
            run_fp_case(case, rank_pool)
