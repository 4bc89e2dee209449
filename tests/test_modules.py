"""The modules check: the formulas give hand-computed numbers, the LFU model keeps what the eviction
policy states, every pinned case passes on this torchrec, the known issue fails as listed, and the
gate entry runs clean."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks import load_check
from paritykit.checks.modules import formulas
from paritykit.checks.modules.dense_cases import run_dense_case
from paritykit.checks.modules.dense_modules import DLRM_MODELS, INTERACTIONS
from paritykit.checks.modules.draws import PINNED
from paritykit.checks.modules.known_broken import KNOWN_BROKEN, MLP_SWISH_DTYPE
from paritykit.checks.modules.mc_cases import MCSpec, run_remapper_case
from paritykit.checks.modules.mc_lookup_cases import PINNED as MC_PINNED
from paritykit.checks.modules.mc_lookup_cases import run_lookup_case
from paritykit.checks.modules.mc_reference import EvictionTable
from paritykit.checks.runner import GateConfig
from paritykit.errors import ParityError
from paritykit.gate.selftest import run_clean


def test_factorization_machine_is_the_sum_of_pairwise_products_of_the_flattened_inputs():
    # x = [1, 2, 3, -1]: 1*2 + 1*3 + 1*(-1) + 2*3 + 2*(-1) + 3*(-1) = 5
    x = [torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[3.0], [-1.0]]])]
    assert formulas.factorization_machine(x).tolist() == [[5.0]]


def test_cross_net_multiplies_by_x0_at_every_layer():
    x0 = torch.tensor([[1.0, 2.0]])
    eye = torch.eye(2)
    # layer 1: x1 = x0 * (x0 + 0) + x0 = [2, 6]; layer 2: x2 = x0 * x1 + x1 = [4, 18]
    assert formulas.cross_net(x0, [eye, eye], [torch.zeros(2), torch.zeros(2)]).tolist() == [[4.0, 18.0]]


def test_vector_cross_net_adds_its_bias_outside_the_product():
    # x1 = x0 (x0 . w) + b + x0 with x0 = [1, 2], w = [1, 1], b = [10, 20]: [3 + 10 + 1, 6 + 20 + 2]
    out = formulas.vector_cross_net(torch.tensor([[1.0, 2.0]]), [torch.ones(2)], [torch.tensor([10.0, 20.0])])
    assert out.tolist() == [[14.0, 28.0]]


def test_layer_norm_over_two_dims_normalizes_every_element_of_the_sample():
    x = torch.tensor([[[1.0, 3.0], [5.0, 7.0]]])  # mean 4, variance 5
    out = formulas.layer_norm(x, 2, torch.ones(2, 2), torch.zeros(2, 2), eps=0.0)
    assert torch.allclose(out, (x - 4) / 5 ** 0.5)


def test_mixture_softmax_is_over_the_experts_of_each_sample():
    weights = formulas.softmax(torch.tensor([[0.0, 0.0], [1.0, 1.0]]), dim=1)
    assert weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_lfu_model_keeps_the_most_frequent_ids_and_gives_ties_to_held_ids():
    table = EvictionTable(zch_size=6, eviction_interval=1)  # 5 ids hold slots
    table.train_forward([10, 20, 10, 30])
    table.train_forward([20, 40, 50])
    assert sorted(table.counts.items()) == [(10, 2), (20, 2), (30, 1), (40, 1), (50, 1)]
    # 60 and 70 tie with the held 30, 40, 50 (one hit each): the held ones stay.
    assert table.train_forward([60, 70, 10, 10, 10]) == [] and not table.holds(60)
    # 60 (3 hits in this window) beats the one-hit ids; of those, held in id order, the largest goes.
    assert table.train_forward([60, 60, 60]) == [50] and table.holds(60) and table.holds(30)


def test_lfu_model_records_until_the_eviction_interval():
    table = EvictionTable(zch_size=3, eviction_interval=2)
    assert table.train_forward([1, 2]) == [] and not table.holds(1)
    table.train_forward([2, 3, 3])
    assert sorted(table.counts) == [2, 3]


def test_lru_model_keeps_the_most_recent_ids_ties_by_count_then_id():
    table = EvictionTable(zch_size=3, eviction_interval=2, policy="lru", decay=2.0)  # 2 ids hold slots
    table.train_forward([1, 1, 2])
    table.train_forward([3, 4, 1])  # 1, 3 and 4 last seen now: 1 (three hits), then 3 (the smaller id)
    assert sorted(table.counts) == [1, 3]
    table.train_forward([5, 5, 5])
    assert table.train_forward([2, 6, 5]) == [1, 3] and sorted(table.counts) == [2, 5]


def test_distance_lfu_model_divides_the_count_by_the_age():
    table = EvictionTable(zch_size=2, eviction_interval=3, policy="distance_lfu")  # 1 id holds a slot
    for ids in ([1, 1, 1, 1, 1], [10, 11, 12, 13, 14], [2, 2, 20, 21, 22]):
        table.train_forward(ids)
    assert sorted(table.counts) == [2]  # 2 / 1 beats 5 / 3
    assert table.score(5, 1) == pytest.approx(5 / 3)


@pytest.mark.parametrize("spec", [spec for specs in PINNED.values() for spec in specs], ids=lambda spec: spec.kind)
def test_every_pinned_dense_case_matches_its_formula_with_every_gradient_compared(spec):
    module_params = run_dense_case(spec)
    # An interaction takes dense and sparse features; a DLRM model the dense features (and a KJT of ids).
    inputs = 2 if spec.kind in INTERACTIONS else 1 if spec.kind in DLRM_MODELS else len(spec.dims or [0])
    assert module_params["outputs"] > 0 and module_params["gradients"] == module_params["parameters"] + inputs


@pytest.mark.parametrize("module", sorted(MC_PINNED))
def test_every_pinned_managed_collision_case_follows_its_policy_and_the_hand_lookup(module):
    for spec in MC_PINNED[module]:
        metrics = (run_remapper_case if module == "remapper" else run_lookup_case)(spec)
        assert metrics["forwards"] >= len(spec.steps)


def test_the_remapper_case_fails_when_the_model_is_given_other_ids():
    # A check that cannot fail proves nothing: a table of capacity 1 fed two ids keeps one of them.
    assert run_remapper_case(MCSpec("remapper", 2, 1, ((5, 6, 6),), (1,)))["ids_holding_slots"] == 1
    with pytest.raises(ParityError, match="lfu gives this id no slot|holds a slot"):
        from paritykit.checks.modules import mc_reference

        original = mc_reference.EvictionTable.holds
        mc_reference.EvictionTable.holds = lambda self, id_: not original(self, id_)
        try:
            run_remapper_case(MCSpec("remapper", 2, 1, ((5, 6, 6),), (1,)))
        finally:
            mc_reference.EvictionTable.holds = original


def test_mlp_swish_layernorm_ignores_its_dtype_as_listed():
    with pytest.raises(ParityError, match="in torch.float32"):
        KNOWN_BROKEN[MLP_SWISH_DTYPE][1]()


def test_the_check_is_registered_with_its_oracle_and_runs_clean():
    check = load_check("modules")
    assert check.oracle and "formula" in check.oracle
    clean = run_clean("modules", GateConfig(device="cpu", world_sizes=(1,), examples=2, seed=3, shrink=False), None)
    assert clean.false_alarms == [] and clean.cases > 20
    assert any(r.case_id.startswith("known-broken") for r in clean.results)


def test_torchrec_evicts_what_the_lfu_model_evicts_on_the_same_sequence():
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule
    from torchrec.sparse.jagged_tensor import JaggedTensor

    module = MCHManagedCollisionModule(zch_size=6, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=1)
    for ids in ([10, 20, 10, 30], [20, 40, 50], [60, 70, 10, 10, 10], [60, 60, 60]):
        module({"t": JaggedTensor(values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))})
    module.eval()
    out = module({"t": JaggedTensor(values=torch.tensor([10, 20, 30, 40, 50, 60, 70]), lengths=torch.tensor([7]))})["t"].values()
    default = 5
    assert [slot == default for slot in out.tolist()] == [False, False, False, False, True, False, True]
