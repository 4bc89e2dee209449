"""A user's own model sharded with torchrec's own plan objects trains like the unsharded model
(paritykit.assert_sharded_matches_unsharded), and every user mistake is named before any rank runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_row_wise, table_wise
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import paritykit
from paritykit import strategies as pks
from ranker_models import positional_ranker, ranker, sequence_model

TUTORIAL_PLAN = {"user": table_wise(rank=1), "item": column_wise(ranks=[1, 0, 1]), "ads": row_wise()}


def kjt(keys, rows):
    lengths = [len(row) for key in keys for row in rows[key]]
    values = [v for key in keys for row in rows[key] for v in row]
    return KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values), lengths=torch.tensor(lengths))


def ranker_batch(shift: int) -> KeyedJaggedTensor:
    rows = {"user_id": [[1 + shift], [], [7]], "item_id": [[2, 3], [4], []], "history": [[5, 5, 6], [], [1]],
            "ad_id": [[], [9 + shift], [10, 11]]}
    return kjt(("user_id", "item_id", "history", "ad_id"), rows)


def ranker_batches(steps: int = 3, world_size: int = 2) -> list[list[KeyedJaggedTensor]]:
    return [[ranker_batch(step + 3 * rank) for rank in range(world_size)] for step in range(steps)]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_a_tutorial_ranker_sharded_tw_cw_on_permuted_ranks_and_rw_trains_like_the_unsharded_one(rank_pool, optimizer):
    metrics = paritykit.assert_sharded_matches_unsharded(ranker, TUTORIAL_PLAN, ranker_batches(), pool=rank_pool,
                                                         embedding_optimizer=optimizer)
    assert metrics == {"steps": 3, "ranks": 2, "state_tensors": 7, "optimizer_state_tensors": 0 if optimizer == "sgd" else 3}


@pytest.mark.world_size(2)
def test_a_sequence_model_sharded_row_and_column_wise_trains_like_the_unsharded_one(rank_pool):
    rows = {"query": [[1, 2], [3]], "title": [[4], []], "tag": [[], [5, 6]]}
    batches = [[kjt(("query", "title", "tag"), rows)] * 2 for _ in range(3)]
    plan = {"words": row_wise(), "tags": column_wise(ranks=[1, 0])}
    assert paritykit.assert_sharded_matches_unsharded(sequence_model, plan, batches, pool=rank_pool)["steps"] == 3


@pytest.mark.world_size(2)
def test_a_model_reading_keyed_tensor_values_by_position_is_told_why_it_differs(rank_pool):
    plan = {"user": table_wise(rank=1), "item": table_wise(rank=0), "ads": table_wise(rank=1)}
    with pytest.raises(paritykit.ParityError, match=r"reads KeyedTensor.values\(\) by position") as caught:
        paritykit.assert_sharded_matches_unsharded(positional_ranker, plan, ranker_batches(steps=1), pool=rank_pool)
    assert "step 0, rank 0: the model's output differs" in str(caught.value)


@pytest.mark.world_size(2)
def test_a_planted_torchrec_bug_fails_naming_step_table_and_element(rank_pool):
    from paritykit.harness import plants

    with plants.applied(["pooled-all-to-all-backward-not-divided"]), pytest.raises(paritykit.ParityError) as caught:
        paritykit.assert_sharded_matches_unsharded(ranker, TUTORIAL_PLAN, ranker_batches(), pool=rank_pool)
    message = str(caught.value)
    assert "step 1, rank 0: embedding module 'ebc' returned other values" in message and "first at ebc[" in message
    assert "after step 2: state (tables gathered from the shards, dense parameters) differs" in message
    assert "state['ebc.embedding_bags.user.weight']" in message


@pytest.mark.world_size(2)
def test_torchrecs_row_wise_mean_defect_shows_in_a_users_model(rank_pool):
    # A row-wise MEAN table beside table-wise ones: torchrec 1.8 divides the others' pooled outputs too.
    plan = {"user": row_wise(), "item": table_wise(rank=0), "ads": table_wise(rank=1)}
    with pytest.raises(paritykit.ParityError, match=r"embedding module 'ebc' returned other values"):
        paritykit.assert_sharded_matches_unsharded(ranker, plan, ranker_batches(steps=1), pool=rank_pool)


@pytest.mark.world_size(2)
def test_torchrecs_own_sharding_plan_object_is_accepted(rank_pool):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    module_plan = construct_module_sharding_plan(ranker().ebc, {"user": data_parallel(), "item": table_wise(rank=0),
                                                                "ads": table_row_wise(host_index=0)},
                                                 world_size=2, local_size=2, device_type="cpu")
    metrics = paritykit.assert_sharded_matches_unsharded(ranker, ShardingPlan({"ebc": module_plan}), ranker_batches(), pool=rank_pool)
    assert metrics["steps"] == 3


@pytest.mark.world_size(2)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(plan=pks.plans_for(ranker(), world_size=2), batches=pks.training_batches_for(ranker(), world_size=2, steps=2))
def test_any_drawn_plan_over_the_users_tables_trains_like_the_unsharded_model(rank_pool, plan, batches):
    assert paritykit.assert_sharded_matches_unsharded(ranker, plan, batches, pool=rank_pool)["steps"] == 2


class NoPool:
    """Stands for a pool in tests of input checks: any use of it means a rank would have run."""

    world_size = 2
    device = "cpu"

    def call(self, *args, **kwargs):
        raise AssertionError("a rank ran although the input was wrong")


@pytest.mark.parametrize(
    "plan, batches, message",
    [
        ({**TUTORIAL_PLAN, "clicks": row_wise()}, ranker_batches(1), r"table\(s\) \['clicks'\] that the model does not have"),
        ({"user": table_wise(rank=1), "item": row_wise()}, ranker_batches(1), r"leaves out table\(s\) \['ads'\]"),
        ({**TUTORIAL_PLAN, "user": table_wise(rank=5)}, ranker_batches(1), r"table 'user'.*rank\(s\) \[5\], outside world size 2"),
        ({**TUTORIAL_PLAN, "item": column_wise(ranks=[0, 1, 2, 3, 0, 1, 2])}, ranker_batches(1), r"table 'item'.*cannot be built"),
        (TUTORIAL_PLAN, [[ranker_batch(0)], [ranker_batch(0), ranker_batch(1)]], r"step 1 has 2 batches but step 0 has 1"),
        (TUTORIAL_PLAN, [[kjt(("user_id", "item_id", "history", "ad_id"),
                              {"user_id": [[1], [2]], "item_id": [[1], []], "history": [[], []], "ad_id": [[99], []]})] * 2],
         r"feature 'ad_id' id 99 at position 0 is outside its table of 24 rows"),
    ],
    ids=["unknown-table", "missing-table", "rank-outside-the-world", "uneven-columns", "ranks-per-step", "id-out-of-range"],
)
def test_a_users_mistake_is_a_harness_error_naming_it_before_any_rank_runs(plan, batches, message):
    with pytest.raises(paritykit.HarnessError, match=message):
        paritykit.assert_sharded_matches_unsharded(ranker, plan, batches, pool=NoPool())


def test_a_kjt_whose_lengths_and_values_disagree_is_named_by_key():
    broken = KeyedJaggedTensor(keys=["user_id", "item_id", "history", "ad_id"], values=torch.tensor([1, 2, 3, 4]),
                               lengths=torch.tensor([1, 1, 1, 1, 1, 0, 0, 0]))
    with pytest.raises(paritykit.HarnessError, match=r"lengths sum to 5 \('user_id': 2, 'item_id': 2, 'history': 1, 'ad_id': 0\) but there are 4 values"):
        paritykit.assert_sharded_matches_unsharded(ranker, TUTORIAL_PLAN, [[broken, broken]], pool=NoPool())


def test_overlapping_shards_are_named_before_any_rank_runs():
    import dataclasses

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    model = ranker()
    good = column_wise(ranks=[0, 1, 0])(model.ebc.embedding_bags["item"].weight, 2, 2, "cpu", EmbeddingBagCollectionSharder())
    shards = good.sharding_spec.shards
    shards[1] = dataclasses.replace(shards[1], shard_offsets=[0, 0])  # the second shard on top of the first
    with pytest.raises(paritykit.HarnessError, match=r"table 'item': element \[0, 0\] is covered by 2 shards \(overlap\)"):
        paritykit.assert_sharded_matches_unsharded(ranker, {**TUTORIAL_PLAN, "item": good}, ranker_batches(1), pool=NoPool())


def test_a_placement_torchrec_does_not_implement_is_reported_as_unsupported_before_any_rank_runs():
    rows = {"query": [[1]], "title": [[2]], "tag": [[3]]}
    with pytest.raises(paritykit.UnsupportedByTorchrec, match=r"does not implement 'table_row_wise'"):
        paritykit.assert_sharded_matches_unsharded(sequence_model, {"words": table_row_wise(host_index=0), "tags": row_wise()},
                                                   [[kjt(("query", "title", "tag"), rows)] * 2], pool=NoPool())


def test_a_model_factory_that_cannot_reach_the_ranks_is_refused():
    with pytest.raises(paritykit.HarnessError, match="model_fn must be picklable"):
        paritykit.assert_sharded_matches_unsharded(lambda: ranker(), TUTORIAL_PLAN, ranker_batches(1), pool=NoPool())


def gather_round_trip_on_rank(full_state):
    model = ranker()
    sharded = paritykit.shard_model(model, TUTORIAL_PLAN)
    paritykit.load_full_state(sharded, full_state)
    gathered = paritykit.gather_full_state(sharded)
    paritykit.assert_close(gathered, full_state, exact=True)
    return sorted(gathered)


@pytest.mark.world_size(2)
def test_public_helpers_shard_a_model_load_its_full_state_and_gather_it_back_exactly(rank_pool):
    full_state = ranker().state_dict()
    assert rank_pool.run(gather_round_trip_on_rank, full_state) == [sorted(full_state)] * 2


def test_ranks_sending_different_dtypes_are_refused_naming_step_and_rank():
    as_int32 = KeyedJaggedTensor(keys=ranker_batch(0).keys(), values=ranker_batch(0).values().int(),
                                 lengths=ranker_batch(0).lengths().int())
    with pytest.raises(paritykit.HarnessError, match=r"step 0: batch on rank 1 has keys and dtypes .*rank 0 has"):
        paritykit.assert_sharded_matches_unsharded(ranker, TUTORIAL_PLAN, [[ranker_batch(0), as_int32]], pool=NoPool())
