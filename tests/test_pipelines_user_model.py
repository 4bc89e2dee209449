"""``assert_pipeline_parity`` for a user's own model: torchrec's plan generators, ModelInput batches,
named pipelines, the unsharded anchor, TD batches, and clear errors before any rank runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from paritykit.checks.pipeline.assertion import assert_pipeline_parity
from paritykit.checks.pipeline.td_input import to_td_batch
from paritykit.errors import HarnessError, ParityError
from paritykit.harness import plants

TABLES = {"user": 20, "item": 30, "ads": 16}


class TutorialRanker(nn.Module):
    """An EmbeddingBagCollection of three tables and an MLP, as in torchrec's introduction; forward
    returns (loss, prediction) as torchrec's pipelines require."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        configs = [EmbeddingBagConfig(name=name, embedding_dim=8, num_embeddings=rows, feature_names=[f"{name}_id"])
                   for name, rows in TABLES.items()]
        self.ebc = EmbeddingBagCollection(configs, device=torch.device("cpu"))
        self.mlp = nn.Sequential(nn.Linear(8 * len(TABLES) + 2, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch):
        pooled = self.ebc(batch.idlist_features).to_dict()
        features = torch.cat([batch.float_features] + [pooled[f"{name}_id"] for name in TABLES], dim=1)
        logit = self.mlp(features).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logit, batch.label), torch.sigmoid(logit)


class PredictionOnlyRanker(TutorialRanker):
    def forward(self, batch):
        return super().forward(batch)[1]


def tutorial_ranker() -> nn.Module:
    return TutorialRanker()


def prediction_only_ranker() -> nn.Module:
    return PredictionOnlyRanker()


def plan():
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    return {"user": table_wise(rank=1), "item": column_wise(ranks=[1, 0]), "ads": row_wise()}


def make_batches(steps: int = 3, world_size: int = 2, batch_size: int = 3):
    from torchrec.distributed.test_utils.test_model import ModelInput
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    source = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(steps):
        per_rank = []
        for _ in range(world_size):
            lengths = torch.randint(0, 3, (len(TABLES) * batch_size,), generator=source)
            chunks = torch.split(lengths, batch_size)
            values = torch.cat([torch.randint(0, rows, (int(c.sum()),), generator=source) for c, rows in zip(chunks, TABLES.values())])
            kjt = KeyedJaggedTensor(keys=[f"{name}_id" for name in TABLES], values=values, lengths=lengths)
            per_rank.append(ModelInput(float_features=torch.randn(batch_size, 2, generator=source), idlist_features=kjt,
                                       idscore_features=None, label=torch.randint(0, 2, (batch_size,), generator=source).float()))
        batches.append(per_rank)
    return batches


@pytest.mark.world_size(2)
def test_a_users_model_matches_under_named_pipelines_and_its_plain_loop_matches_the_unsharded_model(rank_pool):
    result = assert_pipeline_parity(tutorial_ranker, plan(), make_batches(), pipelines=("sparse_dist", "fused:new", "semi_sync"),
                                    pool=rank_pool, embedding_optimizer="rowwise_adagrad", semi_sync_start_batch=1)
    assert result.anchor["steps"] == 3 and result.anchor["ranks"] == 2
    assert [c.candidate for c in result.comparisons] == ["sparse_dist", "fused:new", "semi_sync"]
    assert [c.max_output_diff for c in result.comparisons[:2]] == [0.0, 0.0]
    assert result.comparisons[2].output_diff[:2] == [0.0, 0.0]


@pytest.mark.world_size(2)
def test_a_users_td_batches_equal_their_kjt_batches_under_each_pipeline(rank_pool):
    batches = make_batches()
    td = [[to_td_batch(b) for b in step] for step in batches]
    result = assert_pipeline_parity(tutorial_ranker, plan(), batches, pipelines=("base", "fused:data_dist"), pool=rank_pool, td_batches=td)
    assert {c.candidate: c.reference for c in result.comparisons} == {
        "base": "plain", "fused:data_dist": "plain", "plain[td]": "plain", "base[td]": "base", "fused:data_dist[td]": "fused:data_dist",
    }


@pytest.mark.world_size(2)
def test_a_planted_pipeline_bug_fails_a_users_model_naming_pipeline_and_step(rank_pool):
    with plants.applied(["skipped-zero-grad"]):
        with pytest.raises(ParityError, match=r"(?s)sparse_dist vs plain: per-step values differ.*step 2, rank"):
            assert_pipeline_parity(tutorial_ranker, plan(), make_batches(), pipelines=("sparse_dist",), pool=rank_pool)


# Each mistake below is refused with no pool at all: nothing reaches a rank.


def test_a_model_that_returns_only_a_prediction_is_a_harness_error():
    with pytest.raises(HarnessError, match=r"need forward\(batch\) to return \(loss, prediction\).*returned a torch.float32 tensor of shape \(3,\)"):
        assert_pipeline_parity(prediction_only_ranker, plan(), make_batches(), pipelines=("sparse_dist",))


def test_batches_that_are_not_pipelineable_are_a_harness_error():
    batches = [[{"features": b.idlist_features} for b in step] for step in make_batches()]
    with pytest.raises(HarnessError, match=r"batches\[0\]\[0\] is a dict: torchrec's train pipelines take a torch.Tensor or a torchrec.streamable.Pipelineable"):
        assert_pipeline_parity(tutorial_ranker, plan(), batches, pipelines=("sparse_dist",))


def test_a_plan_naming_a_table_the_model_lacks_is_a_harness_error_naming_it():
    from torchrec.distributed.sharding_plan import table_wise

    with pytest.raises(HarnessError, match=r"names table\(s\) \['clicks'\] that the model does not have"):
        assert_pipeline_parity(tutorial_ranker, {**plan(), "clicks": table_wise(rank=0)}, make_batches(), pipelines=("sparse_dist",))


def test_a_kjt_whose_lengths_do_not_match_its_values_is_a_harness_error_naming_step_and_rank():
    batches = make_batches()
    kjt = batches[1][1].idlist_features
    short = type(kjt)(keys=kjt.keys(), values=kjt.values()[:-1], lengths=kjt.lengths())
    batches[1][1] = replace(batches[1][1], idlist_features=short)
    with pytest.raises(HarnessError, match=r"step 1, rank 1, batch\.idlist_features: the lengths sum to \d+ .* but there are \d+ values"):
        assert_pipeline_parity(tutorial_ranker, plan(), batches, pipelines=("sparse_dist",))


def test_an_unknown_pipeline_name_is_a_harness_error():
    with pytest.raises(HarnessError, match=r"unknown pipeline\(s\) \['prefetch'\]"):
        assert_pipeline_parity(tutorial_ranker, plan(), make_batches(), pipelines=("prefetch",))


def test_the_model_form_needs_a_plan_and_batches():
    with pytest.raises(HarnessError, match="give the plan and batches"):
        assert_pipeline_parity(tutorial_ranker, plan())


@pytest.mark.world_size(1)
def test_a_pool_of_another_size_than_the_batches_is_a_harness_error(rank_pool):
    with pytest.raises(HarnessError, match=r"the batches are for 2 ranks .* the pool has 1"):
        assert_pipeline_parity(tutorial_ranker, plan(), make_batches(), pipelines=("sparse_dist",), pool=rank_pool)
