"""The one device resolver, and the binding every rank runs first (on CPU here, the same code as on CUDA)."""

from __future__ import annotations

import pytest
import torch

from paritykit.dist import RankPool
from paritykit.errors import HarnessError
from paritykit.harness.devices import (
    bind_rank, collective_device, default_backend, host_cores, rank_device, resolve_device, threads_per_rank,
)


@pytest.mark.parametrize(
    "requested, ranks, gpus, device",
    [(None, 1, 0, "cpu"), ("auto", 1, 1, "cuda"), ("auto", 2, 1, "cpu"), ("auto", 8, 8, "cuda"), ("cpu", 16, 8, "cpu"),
     ("cuda", 1, 1, "cuda"), ("cuda", 4, 8, "cuda")],
)
def test_auto_means_cuda_only_with_a_gpu_for_every_rank_on_the_host(requested, ranks, gpus, device):
    assert resolve_device(requested, ranks_per_host=ranks, gpus=gpus) == device


def test_cuda_with_more_ranks_than_gpus_is_refused_naming_both_numbers():
    with pytest.raises(HarnessError, match=r"device 'cuda' with 2 ranks on this host needs one GPU per rank \(nccl refuses "
                                          r"two ranks on one GPU\); this machine has 1: use a world size of at most 1"):
        resolve_device("cuda", ranks_per_host=2, gpus=1)


def test_cuda_without_any_gpu_and_an_unknown_device_are_refused():
    with pytest.raises(HarnessError, match="torch sees no CUDA device"):
        resolve_device("cuda", gpus=0)
    with pytest.raises(HarnessError, match=r"device must be one of \('auto', 'cpu', 'cuda'\), got 'tpu'"):
        resolve_device("tpu")


def test_backend_follows_the_device():
    assert (default_backend("cpu"), default_backend("cuda")) == ("gloo", "nccl")
    with pytest.raises(HarnessError, match="got 'auto'"):
        default_backend("auto")


def bound_threads_and_devices():
    return torch.get_num_threads(), str(rank_device("cpu")), str(collective_device("gloo"))


def test_every_pool_rank_binds_to_its_device_with_its_share_of_the_cores():
    with RankPool(2, device="cpu", preload=("torch",)) as pool:
        results = pool.run(bound_threads_and_devices)
    assert results == [(max(1, host_cores() // 2), "cpu", "cpu")] * 2


def test_binding_a_rank_to_a_gpu_this_host_lacks_is_refused_before_it_joins():
    if torch.cuda.device_count() > 3:
        pytest.skip("this machine has GPU 3; the refusal cannot happen")
    with pytest.raises(HarnessError, match=r"local rank 3 needs GPU 3, but this host has \d GPUs"):
        bind_rank("cuda", local_rank=3, ranks_on_host=4)


def test_threads_per_rank_split_the_cores_and_never_drop_below_one():
    assert threads_per_rank(1) == host_cores()
    assert threads_per_rank(host_cores() * 4) == 1


def cuda_binding():
    return torch.cuda.current_device(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only test: no CUDA device on this machine")
def test_a_cuda_rank_owns_the_gpu_of_its_local_rank_with_tf32_off():
    with RankPool(1, device="cuda", preload=("torch",)) as pool:
        assert pool.backend == "nccl"
        assert pool.run(cuda_binding) == [(0, False, False)]
