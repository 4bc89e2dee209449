"""Planted bugs in torchrec's sharded KJT/VBE paths: each changes torchrec's numbers (shown by a plain
comparison of torchrec's own outputs and tables with and without it), the td-kjt check catches it
against the unsharded module, and the old comparison of a sharded TensorDict with the same sharded
module fed a KJT does not."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.runner import GateConfig
from paritykit.checks.td_kjt import cases as td_kjt
from paritykit.checks.td_kjt.batches import route_input
from paritykit.checks.td_kjt.pinned import pinned_cases
from paritykit.checks.td_kjt.rank import (
    LEARNING_RATE,
    TD_VS_KJT,
    VS_UNSHARDED,
    report_case_on_rank,
    shard_case,
)
from paritykit.checks.td_kjt.reference import loss_of, outputs_by_key
from paritykit.checks.td_kjt.sharded_spec import ROUTE_KJT
from paritykit.harness import plants
from paritykit.harness.sharded import (
    copy_full_weights_into,
    gather_full_weights,
    sgd_step_dense_parameters,
)
from paritykit.harness.tables import seeded_full_weights

CPU = torch.device("cpu")

# plant -> the pinned case (world size 2) whose numbers it changes:
#   1: EBC, VBE with one batch size for every feature, the plan reordering features;
#   3: EC, VBE with one batch size, features reordered inside one sharding;
#   0: EBC, weighted, VBE, two sharding types (the input is split by sharding).
SHARDED_PLANTS = {
    "vbe-inverse-indices-unpermuted": 1,
    "ec-vbe-inverse-indices-unpermuted": 3,
    "split-weights-not-offset": 0,
    "vbe-gradient-not-divided": 0,
}


def torchrec_numbers_on_rank(case):
    """torchrec alone: the sharded module's outputs of step 0 (KJT input) and its tables after one step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    module = shard_case(case, CPU)
    copy_full_weights_into(module, seeded_full_weights(case.tables, case.seed))
    outputs = outputs_by_key(case.module, module(route_input(case.steps[0][rank], ROUTE_KJT, case.form, CPU)))
    values = {key: (v.values() if case.module == "ec" else v).detach().clone() for key, v in outputs.items()}
    if not case.train:
        return values, {}
    loss_of(case, 0, rank, outputs).backward()
    sgd_step_dense_parameters(module, LEARNING_RATE)
    return values, gather_full_weights(module)


def _differs(a: dict, b: dict) -> bool:
    return sorted(a) != sorted(b) or any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(SHARDED_PLANTS))
def test_planted_bug_changes_torchrecs_own_numbers(rank_pool, plant: str) -> None:
    case = pinned_cases(2, "cpu")[SHARDED_PLANTS[plant]]
    clean = rank_pool.run(torchrec_numbers_on_rank, case)
    with plants.applied([plant]):
        planted = rank_pool.run(torchrec_numbers_on_rank, case)
    assert any(_differs(c[0], p[0]) or _differs(c[1], p[1]) for c, p in zip(clean, planted))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("plant", sorted(SHARDED_PLANTS))
def test_planted_bug_is_caught_against_the_unsharded_module_but_not_by_td_vs_kjt(rank_pool, plant: str) -> None:
    case = pinned_cases(2, "cpu")[SHARDED_PLANTS[plant]]
    assert all(not r.problems for r in rank_pool.run(report_case_on_rank, case))
    with plants.applied([plant]):
        reports = rank_pool.run(report_case_on_rank, case)
    kinds = set().union(*(r.kinds() for r in reports))
    assert VS_UNSHARDED in kinds
    assert TD_VS_KJT not in kinds  # the old two-way comparison would have passed


@pytest.mark.slow
@pytest.mark.parametrize("plant", sorted(SHARDED_PLANTS))
def test_gate_run_of_the_td_kjt_check_fails_under_the_planted_bug(rank_pools, plant: str) -> None:
    config = GateConfig(world_sizes=(2,), examples=1, seed=0, shrink=False)
    with plants.applied([plant]):
        results = td_kjt.run_matrix(config, rank_pools)
    caught = [r for r in results if r.status == "fail" and not r.case_id.startswith("known-broken")]
    assert caught and VS_UNSHARDED in caught[0].message
