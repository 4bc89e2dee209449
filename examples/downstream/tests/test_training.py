"""Our model sharded the way we ship it trains exactly like the unsharded model, step by step, and
torchrec's training pipelines train it like a plain loop."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import paritykit
from paritykit import strategies as pks
from recsys_model import (DENSE_FEATURES, FEATURES, SEQUENCE_VOCAB, VOCAB, Batch, RankingModel, SequenceModel,
                          TrainingModel, embedding_tables)

# How we shard in production: tags column-wise with its shards on ranks 1 then 0, ads row-wise,
# history (MEAN pooled) table-wise.
PRODUCTION_PLAN = {"history": table_wise(rank=1), "tags": column_wise(ranks=[1, 0]), "ads": row_wise()}


def ranking_model() -> RankingModel:
    return RankingModel(seed=5)


def training_model() -> TrainingModel:
    return TrainingModel(seed=5)


def sequence_model() -> SequenceModel:
    return SequenceModel(seed=5)


def kjt_batches(steps: int = 3, world_size: int = 2, batch_size: int = 3, seed: int = 0, vocab: dict = VOCAB) -> list[list[KeyedJaggedTensor]]:
    """``batches[step][rank]``: every rank reads its own batch, as a data loader would feed it."""
    source = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        per_rank = []
        for _ in range(world_size):
            lengths = torch.randint(0, 4, (len(vocab) * batch_size,), generator=source)
            chunks = torch.split(lengths, batch_size)
            values = torch.cat([torch.randint(0, rows, (int(c.sum()),), generator=source) for rows, c in zip(vocab.values(), chunks)])
            per_rank.append(KeyedJaggedTensor(keys=list(vocab), values=values, lengths=lengths))
        out.append(per_rank)
    return out


def pipeline_batches(steps: int = 4, world_size: int = 2, batch_size: int = 3) -> list[list[Batch]]:
    source = torch.Generator().manual_seed(1)
    return [
        [Batch(torch.randn(batch_size, DENSE_FEATURES, generator=source), kjt, torch.randint(0, 2, (batch_size,), generator=source).float())
         for kjt in step]
        for step in kjt_batches(steps, world_size, batch_size, seed=1)
    ]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_our_production_plan_trains_three_steps_like_the_unsharded_model(rank_pool, optimizer):
    compared = paritykit.assert_sharded_matches_unsharded(ranking_model, PRODUCTION_PLAN, kjt_batches(), pool=rank_pool,
                                                          embedding_optimizer=optimizer)
    assert compared["steps"] == 3 and compared["ranks"] == 2


@pytest.mark.world_size(2)
def test_our_sequence_model_sharded_row_and_column_wise_trains_like_the_unsharded_one(rank_pool):
    plan = {"words": row_wise(), "titles": column_wise(ranks=[1, 0])}
    batches = kjt_batches(vocab=SEQUENCE_VOCAB)
    compared = paritykit.assert_sharded_matches_unsharded(sequence_model, plan, batches, pool=rank_pool, embedding_optimizer="adagrad")
    assert compared["steps"] == 3


@pytest.mark.world_size(2)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_plan_torchrec_offers_trains_like_the_unsharded_model(rank_pool, data):
    plan = data.draw(pks.plans_for(embedding_tables(), world_size=2), label="plan")
    batches = data.draw(pks.training_batches_for(embedding_tables(), world_size=2, steps=2), label="batches")
    paritykit.assert_sharded_matches_unsharded(ranking_model, plan, batches, pool=rank_pool)


@pytest.mark.world_size(2)
def test_the_fused_and_semi_sync_pipelines_train_our_model_like_a_plain_loop(rank_pool):
    result = paritykit.assert_pipeline_parity(
        training_model, PRODUCTION_PLAN, pipeline_batches(), pipelines=("sparse_dist", "fused:new", "semi_sync"),
        pool=rank_pool, embedding_optimizer="rowwise_adagrad", semi_sync_start_batch=1,
    )
    assert [c.candidate for c in result.comparisons] == ["sparse_dist", "fused:new", "semi_sync"]
