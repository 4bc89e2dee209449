"""Every planted bug of the resharding and state-surface cases: first shown to move torchrec's own
state (the sharded model with and without the plant, no oracle involved), then caught by its case."""

from __future__ import annotations

import pytest

from paritykit.checks.sharding import dmp_state_plants
from paritykit.checks.sharding.dmp_cases import dmp_setup, run_dmp_case
from paritykit.checks.sharding.dmp_reshard_cases import reshard_cases
from paritykit.checks.sharding.dmp_surface import run_surface_case, surface_cases, surface_on_rank, surface_setup
from paritykit.compare import find_differences
from paritykit.engine.training import assemble_records, train_on_rank
from paritykit.errors import ParityError, RankFailure
from paritykit.harness import plants

RESHARD_PLANTS = {"reshard-row-wise-state-not-copied": (2, "reshard-rowwise")}
# plant -> (index of its case in surface_cases, the record entries it moves)
SURFACE_PLANTS = {
    "dmp-named-buffers-recurse-into-sharded": (0, ("buffers",)),
    "sharded-state-load-reverses-cw-shards": (0, ("reloaded",)),
    "ec-dtensor-state-dict-drops-tables": (2, ("keys", "kinds", "pieces")),
}


def test_every_state_plant_has_a_case():
    registered = {name for name, plant in plants.PLANTS.items() if plant.module == dmp_state_plants.__name__}
    assert registered == set(RESHARD_PLANTS) | set(SURFACE_PLANTS)


def _reshard_case(plant: str):
    world_size, name = RESHARD_PLANTS[plant]
    return next(case for case in reshard_cases(world_size) if case.name == name)


def _reshard_plant(pool, plant: str) -> None:
    case = _reshard_case(plant)
    clean = assemble_records(pool.call(train_on_rank, (dmp_setup(case),)))
    with plants.applied([plant]):
        planted = assemble_records(pool.call(train_on_rank, (dmp_setup(case),)))
        assert find_differences((planted.state, planted.fused_state), (clean.state, clean.fused_state), exact=True), \
            f"{plant} leaves the resharded state unchanged"
        with pytest.raises(ParityError, match="differs"):
            run_dmp_case(case, pool)
    assert run_dmp_case(case, pool)["steps"] == 3


@pytest.mark.world_size(2)
def test_the_row_wise_reshard_plant_moves_the_state_and_its_case_catches_it(rank_pool):
    _reshard_plant(rank_pool, "reshard-row-wise-state-not-copied")


def _split_offsets_restart(original):
    """The planted bug of the split case: a column block split between two new blocks sends every piece
    from its first column (the running source offset restarts at 0 for each piece)."""
    def allocate(*args, **kwargs):
        mapping = original(*args, **kwargs)
        return {src: [(shard, local, dst, [0, end - start]) for shard, local, dst, (start, end) in moves]
                for src, moves in mapping.items()}

    return allocate


def train_with_split_offsets_restart(setup):
    """On every rank: train_on_rank with the planted bug (not in the catalog: selftest runs two ranks)."""
    from torchrec.distributed.sharding import dynamic_sharding

    from paritykit.harness.patching import replaced

    with replaced(dynamic_sharding, "_generate_shard_allocation_metadata", _split_offsets_restart):
        return train_on_rank(setup)


@pytest.mark.slow
@pytest.mark.world_size(3)
def test_the_split_offsets_plant_moves_the_state_and_the_split_case_catches_it(rank_pool):
    from paritykit.checks.sharding.dmp_cases import tolerance_of
    from paritykit.engine.comparison import compare_records
    from paritykit.engine.reference import train_reference
    from paritykit.harness.sharded import gradient_division

    case = next(case for case in reshard_cases(3) if case.name == "reshard-split")
    setup = dmp_setup(case)
    clean = assemble_records(rank_pool.call(train_on_rank, (setup,)))
    planted = assemble_records(rank_pool.call(train_with_split_offsets_restart, (setup,)))
    assert find_differences(planted.state, clean.state, exact=True), "the plant leaves the resharded tables unchanged"
    reference = train_reference(setup, division=gradient_division())
    with pytest.raises(ParityError, match="differs"):
        compare_records(planted, reference, tolerance_of(case), case.describe())
    assert compare_records(clean, reference, tolerance_of(case), case.describe())["steps"] == 3


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(SURFACE_PLANTS))
def test_a_surface_plant_moves_torchrecs_state_and_its_case_catches_it(rank_pool, plant):
    index, entries = SURFACE_PLANTS[plant]
    case = surface_cases(2)[index]
    setup = surface_setup(case)
    clean = rank_pool.call(surface_on_rank, (setup, case.output_dtensor))
    with plants.applied([plant]):
        try:
            planted = rank_pool.call(surface_on_rank, (setup, case.output_dtensor))
        except RankFailure:
            planted = None  # torchrec failed under the plant: that moves its state too
        if planted is not None:
            moved = [d for entry in entries for a, e in zip(planted, clean)
                     for d in find_differences(_comparable(a[entry]), _comparable(e[entry]), exact=True)]
            assert moved, f"{plant} leaves {entries} unchanged"
        with pytest.raises((ParityError, RankFailure)):
            run_surface_case(case, rank_pool)
    assert run_surface_case(case, rank_pool)["ranks"] == 2


def _comparable(value):
    """Pieces (dataclasses holding tensors) by name and offsets; anything else as it is."""
    if isinstance(value, list) and value and hasattr(value[0], "offsets"):
        return {f"{piece.name}@{piece.offsets}": piece.tensor for piece in value}
    return value


def test_the_surface_cases_compare_names_state_and_loose_loads():
    cases = surface_cases(2)
    assert [case.output_dtensor for case in cases] == [False, True, True, False, True]
    assert {case.base.module for case in cases} == {"ebc", "ec"}
    # One on dense kernels: rank 0's column-wise TBE holds t1's two shards, then t2's.
    assert {cases[3].base.kernel_of(t.name) for t in cases[3].base.tables} == {"dense"}
    # The last with row-wise Adagrad: its 1-D state of t1's two column shards on rank 0 is one DTensor.
    assert cases[-1].base.optimizer == "rowwise_adagrad" and cases[-1].base.plan["t1"] == ("column_wise", (0, 1, 0))


def test_a_dtensor_local_tensor_smaller_than_its_shards_is_caught():
    from paritykit.checks.sharding.dmp_surface import wrapper_problems

    good = {"wrappers": [("optimizer t1.momentum1", (16,), [(8,), (8,)]), ("t1.weight", (8, 8), [(8, 4), (8, 4)])]}
    short = {"wrappers": [("optimizer t1.momentum1", (8,), [(8,), (8,)])]}
    flat = {"wrappers": [("t1.weight", (64,), [(8, 4), (8, 4)])]}
    assert wrapper_problems([good]) == []
    problems = wrapper_problems([good, short, flat])
    assert [p.split(":")[0] for p in problems] == ["rank 1", "rank 2"], problems
    assert "shape (8,), its local shards [(8,), (8,)] (16 elements)" in problems[0]


def test_a_printout_that_raises_or_leaves_out_a_lookup_or_submodule_is_caught():
    from paritykit.checks.sharding.dmp_surface import printout_problems

    setup = surface_setup(surface_cases(2)[0])
    names = sorted({name.rsplit(".", 1)[-1] for name, _ in setup.model_fn().named_modules() if name})
    whole = " ".join(f"({name}): " for name in names) + " GroupedPooledEmbeddingsLookup"
    good = {"printout": {"text": whole, "lookups": ["GroupedPooledEmbeddingsLookup"]}}
    assert printout_problems(setup, [good, good]) == []
    raised = {"printout": {"error": "TypeError: can't multiply sequence by non-int of type 'str'", "lookups": []}}
    lacking = {"printout": {"text": whole.replace(f"({names[0]}): ", ""), "lookups": ["GroupedPooledEmbeddingsLookup"]}}
    unnamed = {"printout": {"text": whole, "lookups": ["GroupedEmbeddingsLookup"]}}
    problems = printout_problems(setup, [raised, lacking, unnamed])
    assert [p.split(":")[0] for p in problems] == ["rank 0", "rank 1", "rank 2"], problems
    assert "raised TypeError" in problems[0] and names[0] in problems[1] and "lookup GroupedEmbeddingsLookup" in problems[2]


def test_a_dtensor_of_another_global_stride_or_an_unknown_name_is_caught():
    from types import SimpleNamespace

    import torch

    from paritykit.checks.sharding.dmp_surface import geometry_problems

    setup = SimpleNamespace(full_state={"t0.weight": torch.zeros(10, 12)})
    assert geometry_problems(setup, [{"geometry": [("t0.weight", (10, 12), (12, 1))]}]) == []
    assert "stride (10, 1)" in geometry_problems(setup, [{"geometry": [("t0.weight", (10, 12), (10, 1))]}])[0]
    assert "no tensor of the unsharded module" in geometry_problems(setup, [{"geometry": [("t9.weight", (1,), (1,))]}])[0]
