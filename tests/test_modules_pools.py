"""The object pools (TensorPool, KeyedJaggedTensorPool), unsharded and sharded row-wise, against the
pool model: the model's meaning, the pinned cases, refusals of malformed specs, the known issues
and the plant that only ranks show."""

from __future__ import annotations

import pytest

from paritykit.checks.modules.known_broken import KNOWN_BROKEN, SHARDED_KNOWN_BROKEN
from paritykit.checks.modules.pool_cases import (PoolSpec, check_pool_results, in_shard_order, pinned_pool_specs,
                                                 run_pool_case, too_long_sample_is_refused)
from paritykit.checks.modules.pool_reference import KJTPoolModel, TensorPoolModel
from paritykit.errors import HarnessError, ParityError

RANK_PLANTS = {"sharded-tensor-pool-lookup-not-unbucketized"}


def test_the_tensor_pool_model_keeps_the_last_of_a_repeated_id_and_zeros_elsewhere():
    model = TensorPoolModel(3, 2)
    model.update([2, 0, 2], [[1, 1], [2, 2], [3, 3]])
    assert model.lookup([2, 1, 0]) == [(3, 3), (0.0, 0.0), (2, 2)]


def test_the_kjt_pool_model_keeps_its_features_in_its_order_and_drops_others():
    model = KJTPoolModel(2, ["b", "a"])
    model.update([1], [{"a": [(1, 0.25)], "x": [(9, 1.0)], "b": []}])
    assert model.lookup([1, 0]) == {"b": [(), ()], "a": [((1, 0.25),), ()]}


def test_ids_in_shard_order_keep_repeats_in_their_order():
    # 5 rows on 2 shards: rows 0-2 and 3-4.
    assert in_shard_order(((4, 0, 4, 2), (3, 1)), 5, 2) == ((0, 2, 4, 4), (1, 3))


def test_malformed_specs_are_harness_errors_naming_the_step_and_ids():
    steps = (("update", ((1,), (1,))),)
    with pytest.raises(HarnessError, match="step 0: ranks 0 and 1 both update id 1"):
        PoolSpec("tensor", 2, 3, "float32", "int64", steps, dim=1)
    with pytest.raises(HarnessError, match=r"step 0: ids \[3\] outside the pool \[0, 3\)"):
        PoolSpec("tensor", 1, 3, "float32", "int64", (("lookup", ((3,),)),), dim=1)
    with pytest.raises(HarnessError, match="sample 0: 3 values of 'f0', whose max length is 2"):
        PoolSpec("kjt", 1, 3, "int64", "int64", (("update", ((0,),)),), features=(("f0", 2),), input_keys=("f0",),
                 lengths=((((3,),),),))


@pytest.mark.parametrize("kind", ["tensor", "kjt"])
def test_the_unsharded_pinned_case_matches_the_model(kind):
    (spec,) = pinned_pool_specs(kind, 1)
    assert run_pool_case(None, spec) == {"ids_looked_up": 7, "lookups": 2}


def test_a_lookup_that_differs_from_the_model_is_a_parity_error_naming_step_rank_and_ids():
    (spec,) = pinned_pool_specs("tensor", 1)
    wrong = {"lookups": [{"dtype": "float32", "rows": [[0.0] * 3] * 2}, {}], "table": [(0, [])]}
    with pytest.raises(ParityError, match=r"step 1 rank 0: lookup of ids \[1, 4\] returned rows"):
        check_pool_results(spec, [wrong])


@pytest.mark.parametrize("rule", sorted(KNOWN_BROKEN))
def test_each_known_broken_configuration_fails_on_this_torchrec(rule):
    _, body = KNOWN_BROKEN[rule]
    with pytest.raises(Exception):
        body()


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["tensor", "kjt"])
def test_the_sharded_pinned_case_matches_the_model_on_both_ranks(kind, rank_pool):
    (spec,) = pinned_pool_specs(kind, 2)
    assert run_pool_case(rank_pool, spec) == {"ids_looked_up": 2 + (1 if kind == "kjt" else 0) + 10, "lookups": 2}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("rule", sorted(SHARDED_KNOWN_BROKEN))
def test_each_sharded_known_broken_configuration_fails_on_this_torchrec(rule, rank_pool):
    _, body = SHARDED_KNOWN_BROKEN[rule]
    with pytest.raises(ParityError):
        body(rank_pool)


@pytest.mark.world_size(2)
def test_planted_lookup_in_shard_order_is_caught_on_the_ranks(rank_pool):
    from paritykit.checks import load_plants
    from paritykit.harness import plants

    load_plants(["modules"])
    (spec,) = pinned_pool_specs("tensor", 2)
    with plants.applied(sorted(RANK_PLANTS)):
        with pytest.raises(ParityError, match=r"step 1 rank 0: lookup of ids \[4, 1\] returned rows"):
            run_pool_case(rank_pool, spec)
    assert run_pool_case(rank_pool, spec)["lookups"] == 2


def test_the_kjt_pool_refuses_a_sample_longer_than_its_feature_max_length():
    assert too_long_sample_is_refused(1, 2) == {"refused": 1}
    with pytest.raises(HarnessError, match="needs a sample longer than the max length 2, got 2"):
        too_long_sample_is_refused(2, 2)
