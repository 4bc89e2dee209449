"""Optimizers as users configure them: OptimizerSpec and its checks in the caller, what torchrec is
given for it, the hypothesis strategies, which rows the reference steps, and the public assertion
with drawn hyper-parameters on a user's model."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import paritykit
from paritykit import strategies as pks
from paritykit.engine.touched_rows import TouchedRows
from paritykit.errors import HarnessError
from paritykit.harness.optimizers import (OptimizerSpec, in_backward_arguments, require_dense_optimizer,
                                          require_embedding_optimizer, supported_fused_optimizers)
from paritykit.harness.optimizers.references import BlockRowWiseAdagrad
from paritykit.harness.tables import TableSpec, build_ebc, build_ec
from ranker_models import ranker
from test_sharded_models import TUTORIAL_PLAN, ranker_batches


def test_a_spec_takes_hyper_parameters_as_keywords_or_as_kwargs_and_pickles():
    spec = OptimizerSpec("rowwise_adagrad", 0.05, eps=1e-3, weight_decay=0.01, weight_decay_mode="counter")
    assert spec == OptimizerSpec("rowwise_adagrad", lr=0.05, kwargs={"eps": 1e-3, "weight_decay": 0.01, "weight_decay_mode": "counter"})
    assert pickle.loads(pickle.dumps(spec)) == spec and hash(pickle.loads(pickle.dumps(spec))) == hash(spec)
    assert spec.describe() == "rowwise_adagrad(lr=0.05, eps=0.001, weight_decay=0.01, weight_decay_mode='counter')"
    assert spec.hyper("counter_halflife") == -1  # the catalog's default
    assert OptimizerSpec.of("sgd", lr=0.3) == OptimizerSpec("sgd", 0.3)
    assert OptimizerSpec("adam", betas=[0.8, 0.9]).kwargs["betas"] == (0.8, 0.9)


@pytest.mark.parametrize("make, message", [
    (lambda: OptimizerSpec("adamax"), "unknown optimizer 'adamax'"),
    (lambda: OptimizerSpec("sgd", lr=0), "lr must be positive"),
    (lambda: OptimizerSpec("sgd", kwargs={"lr": 0.1}), "give the learning rate as lr="),
    (lambda: OptimizerSpec("adagrad", kwargs={"eps": 1.0}, eps=2.0), r"\['eps'\] given both"),
])
def test_a_malformed_spec_is_a_harness_error(make, message):
    with pytest.raises(HarnessError, match=message):
        make()


@pytest.mark.parametrize("spec, message", [
    (OptimizerSpec("sgd", momentum=0.9), "'momentum': fbgemm's fused sgd kernel does not read it"),
    (OptimizerSpec("adagrad", weight_decay=0.01), "'weight_decay': fbgemm's fused adagrad kernel does not read it"),
    (OptimizerSpec("rowwise_adagrad", weight_decay=0.01), "without a 'weight_decay_mode'"),
    (OptimizerSpec("rowwise_adagrad", counter_halflife=2), "need weight_decay_mode='counter'"),
    (OptimizerSpec("rowwise_adagrad", weight_decay_mode="cowclip"), "'weight_decay_mode' must be one of"),
    (OptimizerSpec("adagrad", eps=-1.0), "'eps' must be a positive float"),
    (OptimizerSpec("ema_rowwise_adagrad", step_ema=0), "'step_ema' must be an int >= 1"),
    (OptimizerSpec("adam"), "'adam' has no fused TBE equivalent"),
])
def test_an_embedding_optimizer_fbgemm_would_not_honour_is_refused_naming_the_key(spec, message):
    with pytest.raises(HarnessError, match=message):
        require_embedding_optimizer(spec)


def test_row_wise_rmsprop_is_offered_exactly_where_fbgemm_trains_it_on_cpu():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    spec = OptimizerSpec("rowwise_rmsprop_ar", 0.1, ar_alpha=0.5)
    has_it = hasattr(EmbOptimType, "ROWWISE_RMSPROP_AR")
    assert ("rowwise_rmsprop_ar" in supported_fused_optimizers("cpu")) == has_it
    if has_it:
        assert require_embedding_optimizer(spec) is spec
    else:
        with pytest.raises(HarnessError, match="has no cpu kernel in the installed fbgemm"):
            require_embedding_optimizer(spec)


def test_fbgemms_cpu_kernels_are_offered_and_its_gpu_only_optimizers_are_not():
    supported = supported_fused_optimizers("cpu")
    assert {"sgd", "adagrad", "rowwise_adagrad", "ema_rowwise_adagrad"} <= set(supported)
    for name in ("adam", "lamb", "lars_sgd"):
        assert name not in supported


@pytest.mark.parametrize("spec, message", [
    (OptimizerSpec("adam", momentum=0.9), r"torch.optim.Adam takes no \['momentum'\]"),
    (OptimizerSpec("adam", betas=(0.9, 1.0)), "Invalid beta parameter"),
    (OptimizerSpec("ema_rowwise_adagrad"), "not a dense optimizer"),
])
def test_a_dense_optimizer_torch_would_refuse_is_a_harness_error(spec, message):
    with pytest.raises(HarnessError, match=message):
        require_dense_optimizer(spec)


def test_torchrec_is_given_fbgemms_own_types_for_a_spec():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.tbe.config.optimizer_config import CounterWeightDecayMode, WeightDecayMode
    from torchrec.optim import RowWiseAdagrad

    cls, kwargs = in_backward_arguments(OptimizerSpec("rowwise_adagrad", 0.2, eps=1e-4, weight_decay=0.01, weight_decay_mode="counter",
                                                      counter_halflife=3, counter_weight_decay_mode="l2"))
    assert cls is RowWiseAdagrad and kwargs["weight_decay_mode"] == WeightDecayMode.COUNTER
    counter = kwargs["counter_based_regularization"]
    assert (counter.counter_halflife, counter.counter_weight_decay_mode) == (3, CounterWeightDecayMode.L2)
    assert {k: kwargs[k] for k in ("lr", "eps", "weight_decay")} == {"lr": 0.2, "eps": 1e-4, "weight_decay": 0.01}
    cls, kwargs = in_backward_arguments(OptimizerSpec("ema_rowwise_adagrad", 0.1, step_ema=2, step_ema_coef=0.3))
    assert kwargs["optimizer"] == EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD
    assert (kwargs["emainplace_mode"].step_ema, kwargs["emainplace_mode"].step_start, kwargs["emainplace_mode"].step_ema_coef) == (2, 0, 0.3)
    cls, kwargs = in_backward_arguments(OptimizerSpec("adagrad", 0.1))
    assert cls is torch.optim.Adagrad and kwargs == {"lr": 0.1, "eps": 1e-8}


@settings(max_examples=60, deadline=None)
@given(pks.embedding_optimizer_specs(), pks.dense_optimizer_specs())
def test_every_drawn_spec_passes_the_checks_and_builds_its_optimizers(embedding, dense):
    assert require_embedding_optimizer(embedding) is embedding
    assert require_dense_optimizer(dense) is dense
    assert embedding.name in supported_fused_optimizers("cpu")
    param = torch.nn.Parameter(torch.ones(3, 2))
    param.grad = torch.full((3, 2), 0.5)
    dense.torch_class()([param], **dense.arguments()).step()
    assert not param.detach().equal(torch.ones(3, 2))


def test_the_strategies_refuse_names_that_are_not_theirs():
    with pytest.raises(ValueError, match="not dense optimizers"):
        pks.dense_optimizer_specs(["lamb"])
    with pytest.raises(ValueError, match="is a fused optimizer the installed fbgemm trains"):
        pks.embedding_optimizer_specs(["adam"])


def test_one_block_row_wise_adagrad_without_weight_decay_is_torchrecs_row_wise_adagrad():
    from torchrec.optim import RowWiseAdagrad

    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(5, 4))
    theirs.data.copy_(ours.data)
    mine, torchrec_one = BlockRowWiseAdagrad([ours], {}, lr=0.1, eps=1e-3), RowWiseAdagrad([theirs], lr=0.1, eps=1e-3)
    for step in range(3):
        grad = torch.randn(5, 4)
        grad[step] = 0.0
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step(), torchrec_one.step()
    torch.testing.assert_close(ours.detach(), theirs.detach())
    torch.testing.assert_close(mine.fused_state(ours)["momentum1"], torchrec_one.state[theirs]["sum"].reshape(-1))


def test_touched_rows_are_the_ids_of_every_feature_a_table_reads():
    tables = (TableSpec("t0", 10, 4, ("f0",)), TableSpec("t1", 8, 4, ("f1", "f0")))
    for module in (build_ebc(tables, seed=0), build_ec(tables, seed=0)):
        touched = TouchedRows({"": module})
        module(KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([3, 1, 3, 7]), lengths=torch.tensor([2, 0, 1, 1])))
        rows = touched.take()
        params = dict(module.named_parameters())
        by_table = {name.split(".")[1]: rows[id(param)].tolist() for name, param in params.items()}
        assert by_table == {"t0": [1, 3], "t1": [1, 3, 7]}
        assert touched.take() == {}
        touched.remove()


@pytest.mark.world_size(2)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pks.embedding_optimizer_specs(), pks.dense_optimizer_specs())
def test_a_users_ranker_trains_like_the_unsharded_one_with_drawn_optimizers(rank_pool, embedding, dense):
    metrics = paritykit.assert_sharded_matches_unsharded(ranker, TUTORIAL_PLAN, ranker_batches(), pool=rank_pool,
                                                         embedding_optimizer=embedding, dense_optimizer=dense)
    assert metrics["steps"] == 3 and metrics["state_tensors"] == 7


def test_an_optimizer_fbgemm_ignores_is_refused_before_any_rank_runs():
    with pytest.raises(HarnessError, match="'momentum'"):
        paritykit.assert_sharded_matches_unsharded(ranker, TUTORIAL_PLAN, ranker_batches(), pool=object(),
                                                   embedding_optimizer=OptimizerSpec("sgd", momentum=0.9))


def test_touched_rows_read_a_tensordict_batch_as_the_module_does():
    from paritykit.convert import kjt_to_td

    tables = (TableSpec("t0", 10, 4, ("f0",)), TableSpec("t1", 8, 4, ("f1",)))
    module = build_ebc(tables, seed=0)
    touched = TouchedRows({"": module})
    module(kjt_to_td(KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([4, 2, 5]), lengths=torch.tensor([1, 1, 1, 0]))))
    rows = touched.take()
    assert sorted(rows[id(p)].tolist() for p in module.parameters()) == [[2, 4], [5]]


def test_the_margin_measure_is_zero_for_equal_records_and_counts_units_of_roundoff():
    from paritykit.checks.sharding.optimizer_margin import worst_units
    from paritykit.engine.training import TrainingRecord

    def record(shift: float) -> TrainingRecord:
        table = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
        return TrainingRecord(outputs=[[torch.ones(2)]], losses=[[torch.tensor(3.0)]], embeddings=[[{}]],
                              state={"t": table + torch.tensor([[0.0, 0.0], [0.0, shift]])}, fused_state={"t/momentum1": table.abs()})

    assert worst_units(record(0.0), record(0.0)) == (0.0, "")
    u = torch.finfo(torch.float32).eps / 2
    units, where = worst_units(record(64 * u * 8), record(0.0))  # 64 u of (|e| + max|e|) = 64 u * 8 at [1, 1]
    assert where == "state['t']" and abs(units - 64) < 1
