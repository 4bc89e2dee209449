"""World sizes are bounded by what the host holds (memory, open files, GPUs), never by a constant."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from paritykit.dist import RankPool
from paritykit.dist import capacity
from paritykit.dist.capacity import GIB, HostResources, ensure_host_holds
from paritykit.errors import HarnessError

ROOMY = HostResources(memory_available_bytes=64 * GIB, memory_source="test", open_files_limit=65536, cores=2, gpus=0)


def touch_bytes_then_report_own_peak(size_bytes):
    block = torch.ones(size_bytes // 4, dtype=torch.float32)
    del block
    return capacity.peak_resident_bytes()


def rank_sum_and_own_peak():
    value = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(value)
    return int(value.item()), capacity.peak_resident_bytes()


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True, "2"])
def test_world_size_that_is_not_a_positive_int_is_refused(world_size):
    with pytest.raises(HarnessError, match="world_size must be a positive int"):
        RankPool(world_size)


def test_memory_rule_refuses_exactly_when_ranks_times_estimate_exceeds_the_available_memory():
    host = HostResources(memory_available_bytes=10 * GIB, memory_source="MemAvailable", open_files_limit=None, cores=2, gpus=0)
    ensure_host_holds(10, "cpu", host, rank_memory_bytes=GIB)  # 10 GiB of 10 GiB: fits
    with pytest.raises(HarnessError) as refused:
        ensure_host_holds(11, "cpu", host, rank_memory_bytes=GIB)
    assert str(refused.value).startswith(
        "this host cannot hold a pool of 11 ranks on cpu: memory: 11 ranks x 1.00 GiB per rank = 11.0 GiB, "
        "but 10.0 GiB is available (MemAvailable); at most 10 ranks fit"
    )


def test_open_files_rule_counts_three_descriptors_per_rank_in_the_owner():
    host = HostResources(memory_available_bytes=None, memory_source="unknown", open_files_limit=1024, cores=2, gpus=0)
    ensure_host_holds(256, "cpu", host, rank_memory_bytes=GIB)  # 3 * 256 + 256 = 1024
    with pytest.raises(HarnessError, match=r"open files: 257 ranks need about 1027 descriptors, but the soft limit \(ulimit -n\) is 1024"):
        ensure_host_holds(257, "cpu", host, rank_memory_bytes=GIB)


def test_cuda_needs_one_gpu_per_rank_on_this_host():
    one_gpu = HostResources(64 * GIB, "test", 65536, cores=16, gpus=1)
    ensure_host_holds(1, "cuda", one_gpu, rank_memory_bytes=GIB)
    with pytest.raises(HarnessError, match=r"2 ranks on this host needs one GPU per rank \(nccl refuses two ranks on one GPU\); this machine has 1"):
        ensure_host_holds(2, "cuda", one_gpu, rank_memory_bytes=GIB)


def test_cores_do_not_bound_the_world_size():
    ensure_host_holds(64, "cpu", ROOMY, rank_memory_bytes=GIB // 2)


def test_a_world_size_this_machine_cannot_hold_is_refused_before_any_rank_starts():
    host = capacity.measure_host()
    if host.memory_available_bytes is None:
        pytest.skip("this operating system does not say how much memory is available")
    too_many = host.memory_available_bytes // capacity.rank_memory_estimate() + 1
    with pytest.raises(HarnessError, match=rf"cannot hold a pool of {too_many} ranks on cpu: memory: {too_many} ranks x"):
        RankPool(too_many, device="cpu")


def test_a_rank_that_peaks_above_the_default_raises_the_estimate_for_later_pools():
    above_default = capacity.DEFAULT_RANK_MEMORY_BYTES + GIB // 4
    with RankPool(1, preload=("torch",)) as pool:
        [own_peak] = pool.run(touch_bytes_then_report_own_peak, above_default)
    assert own_peak > above_default
    assert capacity.rank_memory_estimate() >= own_peak


def test_five_ranks_run_where_four_used_to_be_the_cap():
    with RankPool(5, preload=("torch",)) as pool:
        results = pool.run(rank_sum_and_own_peak)
    assert [total for total, _ in results] == [15] * 5
