"""torchrec's train pipelines against a plain loop: the stream shim and the exact-parity promise."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks.pipeline.assertion import assert_pipeline_parity, builtin_case
from paritykit.checks.pipeline.comparison import normalized_entropy, predictions
from paritykit.engine.builtin_models import DataSpec, ModelFactory, ModelSpec
from paritykit.engine.pipeline_runs import EXACT_PIPELINES, FUSED_PIPELINES, PipelineJob, RunSpec, run_pipeline, run_plain
from paritykit.checks.pipeline.verdicts import anchor_unsound, assert_identical
from paritykit.engine.training import TrainingRecord
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.cpu_shim import stream_shim

ALL_SHARDINGS = ("table_wise", "row_wise", "column_wise")


def test_stream_shim_makes_cpu_record_stream_a_noop_and_restores_it():
    tensor = torch.ones(3)
    cpu_stream = torch.cpu.current_stream()
    with pytest.raises(RuntimeError, match="unknown parameter type"):
        tensor.record_stream(cpu_stream)
    with stream_shim(force=True) as patched:
        assert patched is True
        assert tensor.record_stream(cpu_stream) is None
    assert "record_stream" not in torch.Tensor.__dict__
    with pytest.raises(RuntimeError, match="unknown parameter type"):
        tensor.record_stream(cpu_stream)


def test_stream_shim_gives_streamless_forwards_the_cpu_device_and_restores_the_class():
    from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward

    original_init = BaseForward.__dict__["__init__"]
    before = BaseForward("f", None, None, None, stream=None)
    assert before._device == torch.device("cuda")  # what makes torchrec call torch.cuda on CPU
    with stream_shim(force=True):
        assert BaseForward("f", None, None, None, stream=None)._device == torch.device("cpu")
    assert BaseForward.__dict__["__init__"] is original_init
    assert BaseForward("f", None, None, None, stream=None)._device == torch.device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_stream_shim_patches_only_without_cuda():
    with stream_shim() as patched:
        assert patched is True


def test_bad_specs_are_rejected_with_clear_errors():
    with pytest.raises(ValueError, match="unknown pipeline 'fused'"):
        RunSpec(pipeline="fused")
    with pytest.raises(ValueError, match="sharding_types"):
        ModelSpec(sharding_types=("diagonal",))
    with pytest.raises(ValueError, match="fused_optimizer"):
        ModelSpec(fused_optimizer="lamb")
    with pytest.raises(ValueError, match="overlap_optimizer only applies"):
        RunSpec(pipeline="sparse_dist", overlap_optimizer=True)
    with pytest.raises(ValueError, match="num_batches"):
        DataSpec(num_batches=-1)
    with pytest.raises(ValueError, match="input_type"):
        RunSpec(input_type="njt")
    with pytest.raises(ValueError, match="semi_sync_start_batch"):
        RunSpec(semi_sync_start_batch=-1)


@pytest.mark.world_size(1)
def test_unknown_pipeline_name_is_a_harness_error(rank_pool):
    with pytest.raises(HarnessError, match="unknown pipeline"):
        assert_pipeline_parity(rank_pool, RunSpec(), ["sparse-dist"])


def test_a_run_with_no_batch_is_a_harness_error_before_any_rank_runs():
    # No pool is needed: the sharding engine refuses an empty batch list in the caller.
    with pytest.raises(HarnessError, match="batches is empty"):
        builtin_case(RunSpec(data=DataSpec(num_batches=0)), 2, ("sparse_dist",))


def test_normalized_entropy_of_a_coin_predicted_at_one_half_is_one():
    import math

    half = torch.tensor(math.log(2.0), dtype=torch.float64)
    record = TrainingRecord(outputs=[[torch.zeros(2)] * 2] * 3, losses=[[half, half]] * 3, embeddings=[], state={})
    labels = [torch.tensor([[0.0, 1.0], [1.0, 0.0]])] * 3
    assert normalized_entropy(record, labels) == pytest.approx(1.0, abs=1e-12)
    assert math.isnan(normalized_entropy(record, None))


def _assert_training_moved_everything(plain: TrainingRecord, spec: RunSpec) -> None:
    # Guards against a vacuous comparison: the state compared must actually have changed.
    initial = ModelFactory(spec.model)().state_dict()
    tables = [key for key in plain.state if ".embedding_bags." in key]
    assert tables and all(not torch.equal(plain.state[key], initial[key]) for key in tables)
    if spec.model.fused_optimizer != "sgd":
        assert plain.fused_state and all(v.abs().sum() > 0 for v in plain.fused_state.values())
    if spec.model.dense_optimizer == "adam":
        assert any(k.endswith("exp_avg") for k in plain.dense_state)


@pytest.mark.world_size(1)
def test_every_exact_pipeline_matches_the_plain_loop_bitwise_on_one_rank(rank_pool):
    spec = RunSpec(
        model=ModelSpec(sharding_types=ALL_SHARDINGS, fused_optimizer="rowwise_adagrad", dense_optimizer="adam"),
        data=DataSpec(num_batches=5),
    )
    result = assert_pipeline_parity(rank_pool, spec, EXACT_PIPELINES)
    assert set(result.runs) == {"plain", *EXACT_PIPELINES}
    assert all(c.candidate_steps == 5 and c.max_output_diff == 0.0 for c in result.comparisons)
    assert result.anchor["steps"] == 5 and result.anchor["ranks"] == 1
    _assert_training_moved_everything(result.runs["plain"], spec)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("fused_optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_fused_and_sparse_dist_match_the_plain_loop_bitwise_on_two_ranks(rank_pool, fused_optimizer):
    spec = RunSpec(
        model=ModelSpec(sharding_types=ALL_SHARDINGS, fused_optimizer=fused_optimizer, dense_optimizer="sgd"),
        data=DataSpec(num_batches=4, seed=1),
    )
    result = assert_pipeline_parity(rank_pool, spec, ("sparse_dist",) + FUSED_PIPELINES)
    assert [c.final_diff["state"] for c in result.comparisons] == [0.0] * (1 + len(FUSED_PIPELINES))
    assert ("skipped" in result.anchor) == (fused_optimizer == "adagrad")
    _assert_training_moved_everything(result.runs["plain"], spec)


def test_the_anchor_is_left_out_with_its_reason_for_element_wise_adagrad_tables_only():
    for optimizer, unsound in (("sgd", False), ("rowwise_adagrad", False), ("adagrad", True)):
        setup = builtin_case(RunSpec(model=ModelSpec(fused_optimizer=optimizer)), 2, ("sparse_dist",)).setup
        assert bool(anchor_unsound(setup)) is unsound
    assert "element-wise Adagrad" in anchor_unsound(setup)


@pytest.mark.world_size(2)
def test_torchrec_test_sparse_nn_matches_under_every_exact_pipeline(rank_pool):
    spec = RunSpec(
        model=ModelSpec(kind="test-sparse-nn", sharding_types=ALL_SHARDINGS, fused_optimizer="adagrad", dense_optimizer="adam"),
        data=DataSpec(num_batches=4),
    )
    result = assert_pipeline_parity(rank_pool, spec, EXACT_PIPELINES)
    assert len(result.comparisons) == len(EXACT_PIPELINES)
    _assert_training_moved_everything(result.runs["plain"], spec)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("num_batches", [1, 2])
def test_fewer_batches_than_the_pipeline_depth_run_every_batch_once(rank_pool, num_batches):
    spec = RunSpec(data=DataSpec(num_batches=num_batches, batch_size=2))
    result = assert_pipeline_parity(rank_pool, spec, ("sparse_dist", "fused:data_dist", "fused:current:after_dd", "semi_sync"))
    assert [len(run.outputs) for run in result.runs.values()] == [num_batches] * 5


@pytest.mark.world_size(2)
def test_per_step_records_have_one_prediction_and_loss_per_rank(rank_pool):
    case = builtin_case(RunSpec(data=DataSpec(num_batches=3, batch_size=3)), 2, ("fused:new",))
    run = run_pipeline(rank_pool, PipelineJob(case.setup, "fused:new"))
    assert len(run.outputs) == 3 and all(len(step) == 2 for step in run.outputs)
    assert [tuple(prediction.shape) for step in run.outputs for prediction in step] == [(3,)] * 6
    assert [tuple(loss.shape) for step in run.losses for loss in step] == [()] * 6
    assert set(run.embeddings[0][0]) == {"sparse", "weighted"}
    # Ranks draw different data, so their predictions differ.
    assert not torch.equal(run.outputs[0][0], run.outputs[0][1])


@pytest.mark.world_size(2)
def test_a_difference_in_final_state_is_reported_with_its_location(rank_pool):
    case = builtin_case(RunSpec(model=ModelSpec(fused_optimizer="adagrad"), data=DataSpec(num_batches=2)), 2, ("fused:data_dist",))
    plain = predictions(run_plain(rank_pool, case.setup))
    fused = run_pipeline(rank_pool, PipelineJob(case.setup, "fused:data_dist"))
    assert_identical(plain, fused, ("plain", "fused:data_dist"), "promised")
    key = next(key for key in fused.state if ".embedding_bags." in key)
    fused.state[key][3, 1] += 1.0
    with pytest.raises(ParityError, match=r"(?s)fused:data_dist vs plain: final state differs.*\['" + key.replace(".", r"\.") + r"'\]\[3, 1\]"):
        assert_identical(plain, fused, ("plain", "fused:data_dist"), "promised")


def test_an_exception_in_paritykits_own_comparison_is_a_harness_error_not_a_finding():
    from paritykit.checks.pipeline.parity import ours
    from paritykit.checks.runner import GateConfig, run_case

    def broken_comparison(reference, candidate):
        return reference["missing"]

    with pytest.raises(HarnessError, match=r"paritykit's broken_comparison failed: KeyError: 'missing'"):
        ours(broken_comparison, {}, {})
    # A finding passes through unchanged.
    with pytest.raises(ParityError, match="differs"):
        ours(lambda: (_ for _ in ()).throw(ParityError("differs")))
    result = run_case("pipeline", "case", GateConfig(), lambda: ours(broken_comparison, {}, {}))
    assert result.status == "error"
