"""The CPU stream shim: patches applied by what this stack needs (probed, not by version), and
anything torchrec reaches that the shim does not cover is a harness error naming the shim and the
torchrec call, never a parity failure."""

import pytest
import torch

from paritykit.engine.builtin_models import DataSpec
from paritykit.checks.pipeline.assertion import builtin_case
from paritykit.engine.pipeline_runs import PipelineJob, RunSpec, run_pipeline
from paritykit.checks.runner import GateConfig, result_from_exception, run_case
from paritykit.errors import HarnessError, ShimGap
from paritykit.harness.cpu_shim import shim_patches, stream_shim, without_patches


def _needed(name):
    return {p.name: p.needed for p in shim_patches()}[name]


def test_each_patch_is_applied_where_its_probe_says_this_stack_needs_it():
    with pytest.raises((RuntimeError, TypeError)):
        torch.zeros(1).record_stream(torch.cpu.current_stream())
    assert _needed("record_stream") is True
    assert _needed("cpu-stream-device") is (not hasattr(torch.cpu.Stream(), "device"))
    assert [p.name for p in shim_patches()] == ["record_stream", "forward-device", "cpu-stream-device"]


def test_cpu_streams_get_a_cpu_device_under_the_shim_and_lose_it_after():
    had_device = hasattr(torch.cpu.current_stream(), "device")
    with stream_shim(force=True):
        assert torch.cpu.current_stream().device == torch.device("cpu")
        assert torch.get_device_module(torch.cpu.current_stream().device) is torch.cpu
    assert hasattr(torch.cpu.current_stream(), "device") is had_device
    assert "__getattr__" not in vars(torch.cpu.Stream)


def test_an_attribute_the_shim_does_not_cover_is_a_harness_error_naming_the_shim_and_the_caller():
    with stream_shim(force=True):
        # torchrec's own probes still see a plain missing attribute.
        assert not hasattr(torch.cpu.current_stream(), "cuda_stream")
        with pytest.raises(ShimGap) as info:
            torch.cpu.current_stream().cuda_stream
    message = str(info.value)
    assert "paritykit's CPU stream shim (paritykit.harness.cpu_shim) does not cover torch.cpu.Stream.cuda_stream" in message
    assert f"{__name__}.test_an_attribute_the_shim_does_not_cover_is_a_harness_error_naming_the_shim_and_the_caller" in message
    assert result_from_exception("pipeline", "id", "replay", info.value, 0.0).status == "error"
    # Without the shim the same reach is a plain AttributeError (what a parity failure would be blamed on).
    with pytest.raises(AttributeError) as plain:
        torch.cpu.current_stream().cuda_stream
    assert not isinstance(plain.value, HarnessError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests a CUDA call on a machine without CUDA; this machine has CUDA")
def test_a_cuda_call_on_a_machine_without_cuda_is_a_gap_of_the_shim():
    with stream_shim(), pytest.raises(ShimGap, match="does not cover a CUDA call that torchrec made on a machine without CUDA"):
        torch.cuda.current_stream()


def test_without_patches_refuses_a_name_the_shim_does_not_have():
    with pytest.raises(ValueError, match="unknown shim patch"):
        with without_patches("no-such-patch"):
            pass


def device_of_the_cpu_stream_under_the_shim():
    with stream_shim(force=True):
        return hasattr(torch.cpu.current_stream(), "device")


@pytest.mark.world_size(2)
def test_patches_left_out_are_left_out_on_the_ranks_too(rank_pool):
    assert rank_pool.run(device_of_the_cpu_stream_under_the_shim) == [True, True]
    with without_patches("cpu-stream-device"):
        expected = hasattr(torch.cpu.Stream(), "device")
        assert rank_pool.run(device_of_the_cpu_stream_under_the_shim) == [expected, expected]


def _lookup_reads_stream_device() -> bool:
    from torchrec.distributed.train_pipeline import utils

    return hasattr(utils, "_start_embedding_lookup_stream_synced")


@pytest.mark.world_size(2)
@pytest.mark.skipif(not _lookup_reads_stream_device(), reason=(
    "needs a torchrec whose fused embedding lookup reads stream.device "
    "(train_pipeline.utils._start_embedding_lookup_stream_synced, torchrec 1.9); this torchrec has none"))
def test_a_torchrec_that_reads_the_cpu_streams_device_is_a_harness_error_without_that_patch(rank_pool):
    spec = RunSpec(data=DataSpec(num_batches=2))
    job = PipelineJob(builtin_case(spec, 2, ("fused:data_dist",)).setup, "fused:data_dist")
    with without_patches("cpu-stream-device"):
        result = run_case("pipeline", "fused", GateConfig(), lambda: {"steps": len(run_pipeline(rank_pool, job).outputs)})
    assert result.status == "error"
    assert "does not cover torch.cpu.Stream.device" in result.message
    assert "_start_embedding_lookup_stream_synced" in result.message
    assert run_case("pipeline", "fused", GateConfig(), lambda: {"steps": len(run_pipeline(rank_pool, job).outputs)}).status == "pass"
