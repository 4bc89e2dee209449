"""TensorDict batches through torchrec's training pipelines: the same numbers as KJT batches, and what
this torchrec does not take (detected by feature, shown by behaviour)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from paritykit.checks.pipeline.assertion import builtin_case
from paritykit.checks.pipeline.matrix import TD_PIPELINES
from paritykit.engine.builtin_models import DataSpec, ModelSpec, batches_of
from paritykit.checks.pipeline.parity import run_parity_case
from paritykit.engine.pipeline_runs import PipelineJob, RunSpec, run_pipeline
from paritykit.checks.pipeline.td_input import (
    check_td_batches,
    td_input_unsupported,
    to_td_batch,
    weighted_td_unsupported,
)
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case
from paritykit.compare import assert_close
from paritykit.convert import kjt_to_td, td_to_kjt
from paritykit.errors import HarnessError, RankFailure, UnsupportedByTorchrec

TD_MODEL = ModelSpec(num_tables=3, sharding_types=("table_wise", "row_wise", "column_wise"), fused_optimizer="adagrad")


@pytest.mark.world_size(2)
def test_td_batches_through_every_kind_of_pipeline_equal_their_kjt_runs_bit_for_bit(rank_pool):
    spec = RunSpec(model=TD_MODEL, data=DataSpec(num_batches=4), semi_sync_start_batch=1)
    result = run_parity_case(builtin_case(spec, 2, TD_PIPELINES, inputs="both"), rank_pool)
    td = {c.candidate: c for c in result.comparisons if c.candidate.endswith("[td]")}
    assert sorted(td) == sorted([f"{p}[td]" for p in ("plain",) + TD_PIPELINES])
    assert all(c.reference == c.candidate.removesuffix("[td]") for c in td.values())
    assert all(c.candidate_steps == 4 and c.max_output_diff == 0.0 for c in td.values())
    assert all(set(c.final_diff.values()) == {0.0} for c in td.values())
    # SemiSync drifts from the plain loop, and its TD run drifts exactly as its KJT run does.
    assert result.metrics()["semi_sync"]["max_output_diff"] > 0.0


def test_a_td_batch_carries_the_kjt_batches_ids_and_keeps_weighted_features_as_kjts():
    batch = batches_of(TD_MODEL, DataSpec(num_batches=1), 1)[0][0]
    converted = to_td_batch(batch)
    assert type(converted.idlist_features).__name__ == "TensorDict"
    assert_close(td_to_kjt(converted.idlist_features), batch.idlist_features, exact=True)
    assert converted.idscore_features is batch.idscore_features  # weighted: torchrec's TD carries no weights
    assert torch.equal(converted.float_features, batch.float_features)


def test_this_torchrec_takes_unweighted_td_input_detected_by_its_features():
    import inspect

    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.sparse import tensor_dict

    assert hasattr(tensor_dict, "maybe_td_to_kjt")
    assert "TensorDict" in str(inspect.signature(ShardedEmbeddingBagCollection.input_dist).parameters["features"].annotation)
    assert td_input_unsupported() == ""


def test_this_torchrec_refuses_weighted_td_shown_by_its_conversion():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from torchrec.sparse.tensor_dict import maybe_td_to_kjt

    weighted = KeyedJaggedTensor(keys=["f"], values=torch.tensor([3, 4]), lengths=torch.tensor([2]), weights=torch.tensor([0.5, 2.0]))
    with pytest.raises(AttributeError, match="_values"):
        maybe_td_to_kjt(kjt_to_td(weighted))
    assert "refuses per-id weights" in weighted_td_unsupported()


def _weighted_td_batches(spec: RunSpec, world_size: int):
    batches = batches_of(spec.model, spec.data, world_size)
    return [[replace(b, idscore_features=kjt_to_td(b.idscore_features)) for b in step] for step in batches]


def test_weighted_td_batches_are_unsupported_before_any_rank_runs():
    spec = RunSpec(model=TD_MODEL, data=DataSpec(num_batches=2))
    with pytest.raises(UnsupportedByTorchrec, match=r"step 0, rank 0, batch\.idscore_features: weighted features as a TensorDict"):
        check_td_batches(_weighted_td_batches(spec, 2), builtin_case(spec, 2, ("sparse_dist",)).setup.model_fn())


@pytest.mark.world_size(2)
def test_weighted_td_batches_fail_inside_torchrecs_sharded_input_dist_in_a_pipeline(rank_pool):
    # What the refusal above spares the user: fed anyway, torchrec fails on the ranks.
    spec = RunSpec(model=TD_MODEL, data=DataSpec(num_batches=2))
    setup = replace(builtin_case(spec, 2, ("sparse_dist",)).setup, batches=_weighted_td_batches(spec, 2))
    with pytest.raises(RankFailure, match=r"(?s)AttributeError.*_values"):
        run_pipeline(rank_pool, PipelineJob(setup, "sparse_dist"))


def test_a_torchrec_without_td_conversion_makes_td_cases_unsupported_before_any_rank_runs(monkeypatch):
    from torchrec.sparse import tensor_dict

    monkeypatch.delattr(tensor_dict, "maybe_td_to_kjt")
    assert "maybe_td_to_kjt is missing" in td_input_unsupported()
    spec = RunSpec(model=TD_MODEL, data=DataSpec(num_batches=2))
    # No pool: the case is refused while it is being built.
    result = run_case("pipeline", "td", GateConfig(), lambda: builtin_case(spec, 2, ("sparse_dist",), inputs="both"))
    assert (result.status, result.message) == ("unsupported", "this torchrec has no TensorDict input (torchrec.sparse.tensor_dict.maybe_td_to_kjt is missing)")
    assert isinstance(result, CaseResult)


def test_a_sharded_ebc_whose_input_dist_takes_no_td_is_detected_by_its_signature(monkeypatch):
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def input_dist(self, ctx, features: KeyedJaggedTensor):  # the shape of a KJT-only torchrec
        raise AssertionError("never called")

    monkeypatch.setattr(ShardedEmbeddingBagCollection, "input_dist", input_dist)
    assert td_input_unsupported() == "this torchrec's sharded EmbeddingBagCollection.input_dist does not take a TensorDict"


def test_a_td_batch_with_an_id_outside_its_table_is_a_harness_error_naming_step_rank_and_feature():
    spec = RunSpec(model=TD_MODEL, data=DataSpec(num_batches=2))
    batches = batches_of(spec.model, spec.data, 2)
    kjt = batches[1][0].idlist_features
    values = kjt.values().clone()
    values[0] = 99
    bad = type(kjt)(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    batches[1][0] = replace(batches[1][0], idlist_features=bad)
    td = [[to_td_batch(b) for b in step] for step in batches]
    first = bad.keys()[next(i for i, n in enumerate(bad.length_per_key()) if n)]
    with pytest.raises(HarnessError, match=rf"step 1, rank 0, batch\.idlist_features: feature '{first}' id 99 at position 0 is outside its table of 24 rows"):
        check_td_batches(td, builtin_case(spec, 2, ("sparse_dist",)).setup.model_fn())
