"""torchrec's sharding_plan helpers against paritykit's shard layout, the users' plan mistakes, the
FP16 wire and weight-init oracles, the dense equivalent of a variable batch; and each one's planted
bug, first shown to move what torchrec computes (no paritykit oracle involved), then caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings

from paritykit.checks.sharding import plan_plants
from paritykit.checks.sharding.case_runner import dense_equivalent, run_sharding_case
from paritykit.checks.sharding.cases import RankBatch, expanded
from paritykit.checks.sharding.codec_oracle import codec_problem
from paritykit.checks.sharding.dmp_cases import dmp_cases, run_dmp_case
from paritykit.checks.sharding.init_bounds import init_bounds_cases, init_ranges_on_rank, run_init_bounds_case
from paritykit.checks.sharding.pinned import pinned_cases
from paritykit.checks.sharding.plan_helper_cases import (UNEVEN_COLUMNS, UNKNOWN_SHARDING_TYPES, helper_of, pinned_plan_helper_cases,
                                                         plan_helper_cases, printout_problems, run_plan_helper_case,
                                                         run_uneven_columns_case, run_unknown_types_case, uneven_columns_problem)
from paritykit.checks.sharding.shard_layout import layout_of, row_blocks
from paritykit.compare import find_differences
from paritykit.engine.training import assemble_records, train_on_rank
from paritykit.checks.sharding.case_runner import case_setup
from paritykit.errors import HarnessError, ParityError
from paritykit.harness import plants


def test_row_blocks_are_torchrecs_documented_examples():
    assert [n for _, n in row_blocks(10, 4)] == [3, 3, 3, 1]
    assert [n for _, n in row_blocks(5, 4)] == [2, 2, 1, 0]
    assert [o for o, _ in row_blocks(5, 4)] == [0, 2, 4, 5]


def test_pinned_placements_resolve_as_paritykit_lays_them_out():
    for case in pinned_plan_helper_cases():
        assert run_plan_helper_case(case)["tables"] == len(case.tables)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(plan_helper_cases())
def test_drawn_placements_resolve_as_paritykit_lays_them_out(case):
    assert run_plan_helper_case(case)["tables"] == len(case.tables)


def test_an_unknown_sharding_type_is_refused():
    assert run_unknown_types_case(UNKNOWN_SHARDING_TYPES)["types"] == len(UNKNOWN_SHARDING_TYPES)


def test_columns_the_ranks_do_not_divide_are_refused_and_an_even_table_is_no_such_case():
    assert run_uneven_columns_case(UNEVEN_COLUMNS)["tables"] == len(UNEVEN_COLUMNS)
    with pytest.raises(ValueError, match="divide evenly"):
        uneven_columns_problem(12, (0, 1, 0))


def test_the_plan_printout_names_every_table_and_shard_and_a_dropped_row_is_caught():
    from torchrec.distributed import types

    case = pinned_plan_helper_cases()[0]
    plan = {name: sharding for name, sharding in torchrec_plan(case).items()}
    module_plan = types.EmbeddingModuleShardingPlan(plan)
    assert printout_problems(module_plan, "sparse.ebc") == []
    garbled = types.EmbeddingModuleShardingPlan(plan)
    text = str(garbled).splitlines()
    last_shard = next(line for line in reversed(text) if line.strip())
    garbled.__class__ = type("Garbled", (types.EmbeddingModuleShardingPlan,),
                             {"__str__": lambda self: "\n".join(line for line in text if line != last_shard)})
    problems = printout_problems(garbled, "sparse.ebc")
    assert len(problems) == 1 and "no row of the printout reads shard" in problems[0], problems


def torchrec_plan(case) -> dict:
    """torchrec's helpers' module plan for the case (no paritykit oracle involved)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=c, feature_names=[f"f_{n}"])
                                         for n, r, c in case.tables], device=torch.device("meta"))
    return construct_module_sharding_plan(ebc, {n: helper_of(e, None) for n, e in case.plan.items()}, world_size=case.world_size,
                                          local_size=case.local_size, device_type="cpu")


def torchrec_layouts(case) -> dict:
    """What torchrec's helpers resolve the case's plan to (no paritykit oracle involved)."""
    return {name: layout_of(sharding, "cpu")[0] for name, sharding in torchrec_plan(case).items()}


# The pinned case whose placements each plan plant changes (row-wise: 9 rows on 4 ranks; CW [0, 1, 0]).
PLAN_PLANTS = {"row-wise-plan-balanced-blocks": 1, "column-wise-plan-ranks-sorted": 0}


@pytest.mark.parametrize("plant", sorted(PLAN_PLANTS))
def test_a_plan_plant_moves_torchrecs_plan_and_the_layout_catches_it(plant):
    case = pinned_plan_helper_cases()[PLAN_PLANTS[plant]]
    clean = torchrec_layouts(case)
    with plants.applied([plant]):
        assert torchrec_layouts(case) != clean, f"{plant} leaves torchrec's plan unchanged"
        with pytest.raises(ParityError, match="against paritykit's shard layout"):
            run_plan_helper_case(case)
    run_plan_helper_case(case)


@pytest.mark.parametrize("placement, message", [
    (lambda sp: sp.table_wise(rank=2), r"'t0'.*rank\(s\) \[2\], outside world size 2"),
    (lambda sp: sp.column_wise(ranks=[0, 2]), r"'t0'.*rank\(s\) \[2\], outside world size 2"),
    (lambda sp: sp.column_wise(ranks=[0, 1, 0]), r"'t0'.*cannot be built.*cannot be evenly divided"),
    (lambda sp: sp.table_row_wise(host_index=1), r"'t0'.*rank\(s\) \[2, 3\], outside world size 2"),
])
def test_a_users_plan_mistake_is_a_harness_error_naming_the_table(placement, message):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp

    from paritykit.harness.plan_resolution import resolve_plan

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=40, feature_names=["f0"]),
                                         EmbeddingBagConfig(name="t1", num_embeddings=8, embedding_dim=8, feature_names=["f1"])],
                                 device=torch.device("meta"))
    with pytest.raises(HarnessError, match=message):
        resolve_plan(ebc, {"t0": placement(sp), "t1": sp.table_wise(rank=0)}, world_size=2, device_type="cpu")


def _recorded(value: torch.Tensor) -> list:
    return [[{"": {"by_key": {"f0": value}}}]]


def test_the_fp16_wire_oracle():
    wire = torch.tensor([0.5, 1.0009765625, -3.25], dtype=torch.float32)  # float16 numbers
    assert codec_problem(_recorded(wire)) == (None, 3)
    problem, _ = codec_problem(_recorded(wire + 1e-4))
    assert "float16 cannot hold" in problem and "key 'f0'" in problem
    problem, _ = codec_problem(_recorded(wire.half()))
    assert "returned torch.float16" in problem


def test_a_variable_batch_expands_to_the_fixed_batch_it_stands_for():
    batch = RankBatch((("f0", ((1,), (2, 3))), ("f1", ((4,),))), (("f0", ((0.5,), (1.0, 2.0))), ("f1", ((3.0,),))),
                      (("f0", (1, 0, 1)), ("f1", (0, 0, 0))))
    assert expanded(batch) == RankBatch((("f0", ((2, 3), (1,), (2, 3))), ("f1", ((4,), (4,), (4,)))),
                                        (("f0", ((1.0, 2.0), (0.5,), (1.0, 2.0))), ("f1", ((3.0,), (3.0,), (3.0,)))))
    assert dense_equivalent(pinned_cases(2)[0]) is None


# -- on ranks -----------------------------------------------------------------------------------------

# The plants the rank tests below show moving torchrec's numbers and caught.
RANK_PLANTS = {"sharded-table-weight-init-bounds-dropped", "row-wise-sequence-output-dist-drops-codecs", "kjt-inverse-indices-rows-reversed"}


def test_every_plan_plant_has_a_test():
    registered = {name for name, plant in plants.PLANTS.items() if plant.module == plan_plants.__name__}
    assert registered == set(PLAN_PLANTS) | RANK_PLANTS


@pytest.mark.world_size(2)
def test_configured_init_bounds_hold_on_every_shard_and_their_plant_is_caught(rank_pool):
    case = init_bounds_cases(2)[0]
    clean = rank_pool.call(init_ranges_on_rank, (case,))
    assert run_init_bounds_case(case, rank_pool)["values"] > 0
    with plants.applied(["sharded-table-weight-init-bounds-dropped"]):
        assert rank_pool.call(init_ranges_on_rank, (case,)) != clean, "the plant leaves the initial weights where they were"
        with pytest.raises(ParityError, match="outside the configured weight_init_min..max"):
            run_init_bounds_case(case, rank_pool)


@pytest.mark.world_size(2)
def test_an_init_fn_sets_every_shard_and_one_left_unapplied_is_caught(rank_pool):
    from types import SimpleNamespace

    from paritykit.checks.sharding.init_bounds import middle

    case = next(c for c in init_bounds_cases(2) if c.constant_init and c.module == "ebc")
    found = rank_pool.call(init_ranges_on_rank, (case,))
    assert run_init_bounds_case(case, rank_pool)["values"] > 0
    # The kernels' own uniform initialisation in the bounds, as if reset_parameters never ran.
    lo, hi = case.tables[1][3:]
    found[0] = {**found[0], "t1": (lo, hi, found[0]["t1"][2])}
    with pytest.raises(ParityError, match=f"table 't1' .*not the {middle(lo, hi)} its init_fn sets"):
        run_init_bounds_case(case, SimpleNamespace(world_size=2, call=lambda *args, **kwargs: found))


@pytest.mark.world_size(2)
def test_an_ec_without_its_row_wise_codec_is_caught_on_the_fp16_wire(rank_pool):
    from paritykit.checks.sharding.dmp_cases import dmp_setup

    case = [c for c in dmp_cases(2) if c.name == "qcomm-fp16" and c.base.module == "ec"][0]
    clean = assemble_records(rank_pool.call(train_on_rank, (dmp_setup(case),)))
    assert run_dmp_case(case, rank_pool)["fp16_wire_values"] > 0
    with plants.applied(["row-wise-sequence-output-dist-drops-codecs"]):
        planted = assemble_records(rank_pool.call(train_on_rank, (dmp_setup(case),)))
        assert find_differences(planted.embeddings, clean.embeddings, exact=True), "the plant leaves the EC's lookups unchanged"
        with pytest.raises(ParityError, match="float16 cannot hold"):
            run_dmp_case(case, rank_pool)


@pytest.mark.world_size(2)
def test_inverse_indices_both_modules_read_wrongly_are_caught_by_the_dense_equivalent(rank_pool):
    case = pinned_cases(2)[6]
    clean = assemble_records(rank_pool.call(train_on_rank, (case_setup(case),)))
    assert run_sharding_case(case, rank_pool)["dense_equivalent_steps"] == 3  # row-wise Adagrad, no weight decay: every step
    with plants.applied(["kjt-inverse-indices-rows-reversed"]):
        planted = assemble_records(rank_pool.call(train_on_rank, (case_setup(case),)))
        assert find_differences(planted.embeddings, clean.embeddings, exact=True), "the plant leaves the lookups unchanged"
        with pytest.raises(ParityError, match="rows expanded by hand"):
            run_sharding_case(case, rank_pool)


def test_the_dense_equivalent_keeps_the_case_but_its_batches():
    case = pinned_cases(2)[6]
    dense = dense_equivalent(case)
    assert dataclasses.replace(dense, steps=case.steps) == case
    assert all(batch.inverse is None for step in dense.steps for batch in step)


def test_the_delta_of_two_plans_holds_what_moved_and_a_wrong_one_is_caught(monkeypatch):
    from torchrec.distributed.sharding import dynamic_sharding

    from paritykit.checks.sharding.plan_delta_cases import MOVED, run_plan_delta_case

    assert run_plan_delta_case() == {"plan_shape": "plan-helpers/delta", "moved": len(MOVED)}
    real = dynamic_sharding.output_sharding_plan_delta_single

    def every_table(old_plan, new_plan, return_data_volume=False):  # a delta that keeps the tables that stayed too
        volume, _ = real(old_plan, new_plan, return_data_volume)
        return volume, new_plan

    monkeypatch.setattr(dynamic_sharding, "output_sharding_plan_delta_single", every_table)
    with pytest.raises(ParityError, match="expected those whose ranks moved"):
        run_plan_delta_case()
