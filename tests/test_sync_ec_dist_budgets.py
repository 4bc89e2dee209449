"""Rank-pool sync budgets of the sharded EmbeddingCollection (world size 2): input_dist (KJT and TD
input) and the whole forward. Exact counts per rank and site are asserted for every budget in
test_sync_dist_budgets.py; these tests pin what the EC budgets rest on (justified in
paritykit/checks/sync/ec_dist_budgets.py).
"""

from __future__ import annotations

import pytest

from paritykit.checks.sync.budgets import DIST_BUDGETS_BY_NAME as BY_NAME
from paritykit.checks.sync.dist_budget import LENGTH_PER_KEY, PLANS, measure_dist, sites_of
from paritykit.checks.sync.ec_dist_budgets import EC_DIST_BUDGETS
from paritykit.checks.sync.inputs import KEYS, LENGTHS


def _sites_per_rank(name, pool, device):
    records, raw = measure_dist(BY_NAME[name], pool, device)
    return [sites_of(per_rank[0]) for per_rank in records], raw


def test_ec_dist_budgets_cover_both_plans_every_input_and_the_forward():
    names = {b.name for b in EC_DIST_BUDGETS}
    for plan in PLANS:
        for kind in ("kjt_moved_with_metadata", "kjt_without_metadata", "torchrec_td", "paritykit_td_to_kjt"):
            assert f"ec_input_dist.ws2.{plan}.{kind}" in names
        for suffix in ("kjt_moved_with_metadata", "kjt_without_metadata", "kjt_moved_with_metadata.need_indices"):
            assert f"ec_forward.ws2.{plan}.{suffix}" in names
    assert {b.name: b.budgets for b in EC_DIST_BUDGETS if b.name.endswith("kjt_without_metadata")} == {
        "ec_input_dist.ws2.table_wise.kjt_without_metadata": (8, 8),
        "ec_input_dist.ws2.row_wise.kjt_without_metadata": (9, 9),
        "ec_forward.ws2.table_wise.kjt_without_metadata": (8, 8),
        "ec_forward.ws2.row_wise.kjt_without_metadata": (9, 9),
    }


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("inputs", ["kjt_moved_with_metadata", "kjt_without_metadata"])
def test_sharded_ec_input_dist_makes_the_sharded_ebc_input_dist_syncs(plan, inputs, rank_pool, paritykit_device):
    # One KJT all-to-all serves both modules: the same syncs at the same sites on every rank.
    ec_sites, _ = _sites_per_rank(f"ec_input_dist.ws2.{plan}.{inputs}", rank_pool, paritykit_device)
    ebc_sites, _ = _sites_per_rank(f"ebc_input_dist.ws2.{plan}.{inputs}", rank_pool, paritykit_device)
    assert ec_sites == ebc_sites


@pytest.mark.parametrize("plan", list(PLANS))
def test_torchrec_td_input_costs_a_kjt_without_metadata_and_td_to_kjt_one_with(plan, rank_pool, paritykit_device):
    measured = {
        kind: _sites_per_rank(f"ec_input_dist.ws2.{plan}.{kind}", rank_pool, paritykit_device)[0]
        for kind in ("torchrec_td", "kjt_without_metadata", "paritykit_td_to_kjt", "kjt_moved_with_metadata")
    }
    assert measured["torchrec_td"] == measured["kjt_without_metadata"]
    assert measured["paritykit_td_to_kjt"] == measured["kjt_moved_with_metadata"]
    for rank in (0, 1):
        # What the TD's metadata saves: exactly the split's read of the input lengths.
        assert measured["torchrec_td"][rank][LENGTH_PER_KEY] - measured["paritykit_td_to_kjt"][rank][LENGTH_PER_KEY] == 1


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("inputs", ["kjt_moved_with_metadata", "kjt_without_metadata"])
def test_lookup_and_output_dist_add_no_sync_to_the_input_dist(plan, inputs, rank_pool, paritykit_device):
    forward, raw = _sites_per_rank(f"ec_forward.ws2.{plan}.{inputs}", rank_pool, paritykit_device)
    input_dist, _ = _sites_per_rank(f"ec_input_dist.ws2.{plan}.{inputs}", rank_pool, paritykit_device)
    assert forward == input_dist
    # The counted forward ran to the end: every feature's embeddings, one row per id of the batch.
    expected_rows = {key: (sum(lens), 4) for key, lens in zip(KEYS, LENGTHS)}
    assert [result["output_rows"] for result in raw] == [expected_rows, expected_rows]


@pytest.mark.parametrize("plan", list(PLANS))
def test_need_indices_returns_the_ids_and_adds_no_sync_to_the_sharded_forward(plan, rank_pool, paritykit_device):
    with_indices, raw = _sites_per_rank(f"ec_forward.ws2.{plan}.kjt_moved_with_metadata.need_indices", rank_pool, paritykit_device)
    without, raw_without = _sites_per_rank(f"ec_forward.ws2.{plan}.kjt_moved_with_metadata", rank_pool, paritykit_device)
    assert with_indices == without
    assert [result["output_has_indices"] for result in raw] == [dict.fromkeys(KEYS, True)] * 2
    assert [result["output_has_indices"] for result in raw_without] == [dict.fromkeys(KEYS, False)] * 2


def test_table_wise_plan_gives_each_rank_its_own_features(rank_pool, paritykit_device):
    # The plan the counts assume: t0's f0 to rank 0, t1's f1 and f2 to rank 1; row-wise: all to both.
    _, table_wise = _sites_per_rank("ec_input_dist.ws2.table_wise.torchrec_td", rank_pool, paritykit_device)
    _, row_wise = _sites_per_rank("ec_input_dist.ws2.row_wise.torchrec_td", rank_pool, paritykit_device)
    assert [result["received_keys"] for result in table_wise] == [[["f0"]], [["f1", "f2"]]]
    assert [result["received_keys"] for result in row_wise] == [[["f0", "f1", "f2"]]] * 2
