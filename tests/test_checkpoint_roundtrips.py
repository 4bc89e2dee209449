"""Checkpoint round trips on the ranks: a user's own model through the public assertion (another
plan, another world size), an EC across world sizes, and the gate entry: every pinned case, and each
known-broken combination failing inside torchrec as its rule says."""

from __future__ import annotations

import re

import pytest
import torch
from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

import paritykit
from paritykit.checks.checkpoint.known_broken import RULES, kept_out_rules
from paritykit.checks.checkpoint.matrix import run_case
from paritykit.checks.checkpoint.pinned import pinned_cases
from paritykit.checks.runner import GateConfig
from paritykit.errors import HarnessError
from paritykit.gate.gating import run_checks
from ranker_models import ranker
from test_sharded_models import ranker_batch, ranker_batches

SAVED_PLAN = {"user": table_wise(rank=1), "item": column_wise(ranks=[0, 1, 0]), "ads": row_wise()}
# MEAN tables stay off row-wise placements: torchrec's known row-wise MEAN defect is the sharding check's.
RELOAD_PLAN = {"user": column_wise(ranks=[1, 0]), "item": table_wise(rank=0), "ads": column_wise(ranks=[1, 1])}


def test_an_embedding_collection_saved_on_two_ranks_resumes_on_one_and_back(rank_pools):
    for case in pinned_cases(2, other=1)[-2:]:
        assert (case.world_size, case.reload_world_size) in ((2, 1), (1, 2))
        assert run_case(case, rank_pools)["world_sizes"] == f"{case.world_size}->{case.reload_world_size}"


def test_a_users_ranker_resumes_on_another_plan_with_adam_on_its_dense_layers(rank_pools):
    metrics = paritykit.assert_checkpoint_roundtrip(ranker, SAVED_PLAN, ranker_batches(steps=4), save_after=2,
                                                    reload_plan=RELOAD_PLAN, embedding_optimizer="adagrad",
                                                    dense_optimizer="adam", pool=rank_pools.get(2))
    assert metrics["steps"] == "2+2" and "resumed vs carried-on run" in metrics["compared"]


def test_a_users_ranker_saved_on_two_ranks_resumes_on_one(rank_pools):
    metrics = paritykit.assert_checkpoint_roundtrip(
        ranker, SAVED_PLAN, ranker_batches(steps=2), save_after=2, reload_plan={"user": table_wise(rank=0), "item": column_wise(ranks=[0, 0, 0]),
                                                                                 "ads": row_wise()},
        reload_batches=ranker_batches(steps=2, world_size=1), embedding_optimizer="rowwise_adagrad", dense_optimizer="adam",
        pool=rank_pools.get(2), reload_pool=rank_pools.get(1))
    assert metrics["world_sizes"] == "2->1" and "resumed run vs unsharded" in metrics["compared"]


def test_a_pool_of_the_wrong_size_is_a_harness_error_before_any_rank_runs(rank_pools):
    with pytest.raises(HarnessError, match="the batches are for 2 ranks.*has 1"):
        paritykit.assert_checkpoint_roundtrip(ranker, SAVED_PLAN, ranker_batches(steps=2), save_after=1, pool=rank_pools.get(1))


KNOWN_BROKEN_SAYS = {
    "dcp-rank-without-a-table-and-empty-optimizer-state": "Missing key in checkpoint state_dict",
    "dcp-dense-kernel-optimizer-state": "rank 0's dense-optimizer state of its dense-kernel shards differs",
    "dense-kernel-table-missing-on-a-rank": "Different parameter count: 1 vs 0",
    "row-wise-state-other-column-blocks": "Size mismatch between saved",
    "per-rank-load-other-shards": r"the model's state \(tables gathered from the shards, dense parameters\) differs from the saved one",
    "dcp-param-groups-per-rank": "Group embedding_bags.t0.weight/embedding_bags.t1.weight not found",
    "warmup-over-combined-optimizer": "the learning rate of the next step differs",
}


def test_the_gate_entry_passes_every_pinned_round_trip_and_marks_every_known_broken_case(rank_pools):
    results, _ = run_checks(["checkpoint"], GateConfig(world_sizes=(2,), examples=4, seed=2), rank_pools)
    failing = [r for r in results if r.status not in ("pass", "known-issue")]
    assert not failing, failing[0].message
    # The failure itself, without the known-issues note (whose reason quotes the same words) in front.
    known = {r.case_id.split()[1]: r.message.split("\n", 1)[1] for r in results if r.status == "known-issue"}
    assert sorted(known) == sorted(rule.name for rule in kept_out_rules())  # a fixed one passes instead
    assert set(KNOWN_BROKEN_SAYS) == {rule.name for rule in RULES}
    for rule, message in known.items():
        # Each fails inside torchrec (or torch.distributed.checkpoint reading its state dicts) as its rule says.
        assert re.search(KNOWN_BROKEN_SAYS[rule], message), f"{rule}: {message[:300]}"
    passed = [r for r in results if r.status == "pass"]
    assert len(passed) == len(pinned_cases(2)) + 1  # and one drawn round trip (4 examples / 4)
    assert all("reloaded vs saved state" in r.metrics["compared"] for r in passed)
    warm = [r for r in passed if "warmup" in r.case_id]
    assert len(warm) == 1 and "resumed run vs unsharded" not in warm[0].metrics["compared"]


def test_a_user_batch_whose_ids_exceed_a_table_is_named_before_any_rank_runs():
    broken = ranker_batch(40)  # user_id 41 > 20 rows
    with pytest.raises(HarnessError, match="user_id"):
        paritykit.assert_checkpoint_roundtrip(ranker, SAVED_PLAN, [[broken, broken], [broken, broken]], save_after=1,
                                              pool_for=lambda size: None)
    assert torch.is_tensor(broken.values())
