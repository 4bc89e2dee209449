"""Every planted bug of the optim check: first shown to move torchrec's own numbers (the sharded
model trained through torchrec's wrappers with and without the plant, no oracle involved), then
caught by the check, on the sharded case and, where one exists, on a case without ranks."""

from __future__ import annotations

import pytest

from paritykit.checks.optim.case_runner import optim_setup, run_optim_case
from paritykit.checks.optim.dense_runner import run_dense_case
from paritykit.checks.optim.matrix import pinned_dense_cases
from paritykit.checks.optim.pinned import pinned_cases
from paritykit.compare import find_differences
from paritykit.engine.optim_training import train_wrapped_on_rank
from paritykit.errors import ParityError
from paritykit.harness import plants

# plant -> (index of the pinned sharded case at world size 2, index of the pinned dense case or None)
PLANT_CASES = {
    "clip-norm-local-shards-only": (0, None),
    "clip-coefficient-not-clamped": (5, None),
    "warmup-multiplier-one-step-late": (3, 1),
    "combined-optimizer-param-groups-copied": (4, 4),
    "rowwise-adagrad-drops-weight-decay": (4, 0),
    "keyed-load-skips-param-groups": (5, 4),
}


def torchrec_side(pool, case) -> list[dict]:
    """Every rank's outputs and pieces of state, as torchrec's side alone produced them."""
    per_rank = pool.call(train_wrapped_on_rank, (optim_setup(case), case.wrapping))
    return [{"outputs": r["outputs"], "state": {f"{p.name}@{p.offsets}": p.tensor for p in r["state"]}} for r in per_rank]


def moved(clean: list[dict], planted: list[dict]) -> list:
    return [d for a, b in zip(clean, planted) for d in find_differences(b, a, exact=True)]


# plants of torchrec's fused-optimizer module: the pinned FusedEmbeddingBagCollection case they move
FUSED_MODULE_PLANTS = {"fused-module-rowwise-adagrad-as-adagrad": 2}
# plants in how the fused module is made -> index of the pinned fused-module case that catches it
FUSED_MODULE_MAKING_PLANTS = {"fused-module-init-bounds-ignored": 0}
# plants only the dense (rank-less) cases reach -> index of the pinned dense case that catches it
DENSE_ONLY_PLANTS = {"rowwise-adagrad-load-recasts-step": 8}


def test_every_optim_plant_has_a_case():
    import paritykit.checks.optim.plants  # noqa: F401 - registers them

    assert {name for name, plant in plants.PLANTS.items() if plant.check == "optim"} == set(PLANT_CASES) | set(FUSED_MODULE_PLANTS) | set(DENSE_ONLY_PLANTS) | set(FUSED_MODULE_MAKING_PLANTS)


def _fused_module_tables(case) -> dict:
    """What FusedEmbeddingBagCollection alone computes: its tables after the case's steps."""
    import torch

    from paritykit.checks.optim.fused_module_cases import _fused_module
    from paritykit.harness.tables import build_ebc, feature_names_of, kjt_from_rows

    fused = _fused_module(case, build_ebc(case.tables, seed=case.seed, init_bounds=case.bounds_of()))
    for batch in case.steps:
        fused(kjt_from_rows(list(feature_names_of(case.tables)), dict(batch.ids))).values().pow(2).sum().backward()
    return {key: value.detach().clone() for key, value in fused.state_dict().items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("plant", sorted(FUSED_MODULE_PLANTS))
def test_the_fused_module_plant_moves_torchrecs_numbers_and_the_check_catches_it(plant):
    import paritykit.checks.optim.plants  # noqa: F401
    from paritykit.checks.optim.fused_module_cases import run_fused_module_case
    from paritykit.checks.optim.matrix import pinned_fused_module_cases

    case = pinned_fused_module_cases()[FUSED_MODULE_PLANTS[plant]]
    clean = _fused_module_tables(case)
    with plants.applied([plant]):
        assert find_differences(_fused_module_tables(case), clean, exact=True), f"{plant} leaves the fused module's tables unchanged"
        with pytest.raises(ParityError, match="differs from the plain module trained by"):
            run_fused_module_case(case)
    assert run_fused_module_case(case)["steps"] == len(case.steps)


def _fresh_fused_tables(case) -> dict:
    """torchrec alone: the tables of the fused module as made, before anything is loaded into it."""
    import importlib

    import torch
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    from paritykit.checks.optim.fused_module_cases import OPTIMIZER_TYPES
    from paritykit.harness.tables import build_ebc

    module_name, class_name = OPTIMIZER_TYPES[case.optimizer].split(":")
    fused = FusedEmbeddingBagCollection(tables=build_ebc(case.tables, seed=case.seed, init_bounds=case.bounds_of()).embedding_bag_configs(),
                                        optimizer_type=getattr(importlib.import_module(module_name), class_name),
                                        optimizer_kwargs=dict(case.hypers), device=torch.device("cpu"))
    return {key: value.detach().clone() for key, value in fused.state_dict().items()}


@pytest.mark.parametrize("plant", sorted(FUSED_MODULE_MAKING_PLANTS))
def test_the_fused_module_making_plant_moves_its_fresh_tables_and_the_check_catches_it(plant):
    import paritykit.checks.optim.plants  # noqa: F401
    from paritykit.checks.optim.fused_module_cases import run_fused_module_case
    from paritykit.checks.optim.known_broken import repair
    from paritykit.checks.optim.matrix import pinned_fused_module_cases

    case = repair(pinned_fused_module_cases()[FUSED_MODULE_MAKING_PLANTS[plant]])
    clean = _fresh_fused_tables(case)
    with plants.applied([plant]):
        assert find_differences(_fresh_fused_tables(case), clean, exact=True), f"{plant} leaves the fresh tables unchanged"
        with pytest.raises(ParityError, match="not drawn uniformly from its configured"):
            run_fused_module_case(case)
    assert run_fused_module_case(case)["steps"] == len(case.steps)


def _loaded_step_dtype():
    """torchrec alone: the step dtype of a RowWiseAdagrad loaded from a checkpoint storing float64 steps."""
    import torch
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    param = torch.nn.Parameter(torch.ones(3, 2))
    saved = RowWiseAdagrad([param], lr=0.1).state_dict()
    saved["state"][0]["step"] = torch.tensor(5.0, dtype=torch.float64)
    fresh = RowWiseAdagrad([param], lr=0.1)
    fresh.load_state_dict(saved)
    return fresh.state[param]["step"].dtype


@pytest.mark.parametrize("plant", sorted(DENSE_ONLY_PLANTS))
def test_the_dense_only_plant_moves_torchrec_and_the_dense_case_catches_it(plant):
    import paritykit.checks.optim.plants  # noqa: F401

    case = pinned_dense_cases()[DENSE_ONLY_PLANTS[plant]]
    clean = _loaded_step_dtype()
    with plants.applied([plant]):
        assert _loaded_step_dtype() != clean, f"{plant} leaves torchrec's loaded state unchanged"
        with pytest.raises(ParityError, match="after load_state_dict"):
            run_dense_case(case)
    assert run_dense_case(case)["compared"] > 0


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(PLANT_CASES))
def test_the_plant_moves_torchrecs_numbers_and_the_check_catches_it(rank_pool, plant):
    import paritykit.checks.optim.plants  # noqa: F401

    sharded, dense = PLANT_CASES[plant]
    case = pinned_cases(2)[sharded]
    clean = torchrec_side(rank_pool, case)
    with plants.applied([plant]):
        assert moved(clean, torchrec_side(rank_pool, case)), f"{plant} leaves torchrec's sharded numbers unchanged"
        with pytest.raises(ParityError, match="differs from the unsharded reference|the schedule says|total gradient norm|replicated"):
            run_optim_case(case, rank_pool)
        if dense is not None:
            with pytest.raises(ParityError):
                run_dense_case(pinned_dense_cases()[dense])
    assert run_optim_case(case, rank_pool)["steps"] == case.steps
    if dense is not None:
        assert run_dense_case(pinned_dense_cases()[dense])


def test_fuse_embedding_optimizer_rewrites_a_model_in_place_into_a_fused_module_that_trains_like_the_plain_one():
    from dataclasses import replace

    from paritykit.checks.optim.fused_module_cases import run_fused_module_case
    from paritykit.checks.optim.matrix import pinned_fused_module_cases

    nested = pinned_fused_module_cases()[-1]
    assert nested.via == "fuse_embedding_optimizer:nested" and "via=fuse_embedding_optimizer:nested" in nested.case_id()
    for case in (nested, replace(nested, via="fuse_embedding_optimizer")):
        assert run_fused_module_case(case)["steps"] == len(case.steps)
