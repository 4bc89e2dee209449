"""RankPool's contract on healthy calls: results, ordering, tensors, seeds, plants, reuse."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random

import numpy
import pytest
import torch
import torch.distributed as dist

from paritykit.harness import plants
from paritykit.dist import RankPool
from paritykit.errors import HarnessError

PLANT_NAME = "test-dist-pool-flag"
_plant_applied = False


@contextlib.contextmanager
def _flag_plant():
    global _plant_applied
    _plant_applied = True
    try:
        yield
    finally:
        _plant_applied = False


def _register_flag_plant():
    if PLANT_NAME not in plants.PLANTS:
        plants.register(PLANT_NAME, check="none: a test of paritykit.dist")(_flag_plant)


# Ranks import this module to unpickle its functions: the plant must be known there as well.
if multiprocessing.parent_process() is not None:
    _register_flag_plant()


@pytest.fixture
def flag_plant():
    """The test plant, registered in this process only for the test (the self-test lists all plants)."""
    _register_flag_plant()
    yield PLANT_NAME
    plants.PLANTS.pop(PLANT_NAME, None)


@pytest.fixture(scope="module")
def pool():
    # torchrec is not needed by these functions; preloading only torch halves the start-up.
    with RankPool(2, preload=("torch",), timeout=60) as pool:
        yield pool


def rank_and_world():
    return dist.get_rank(), dist.get_world_size(), os.getpid()


def all_reduce_rank_plus(offset):
    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return value.item()


def ranked_tensor(rows, cols):
    return torch.full((rows, cols), float(dist.get_rank()), dtype=torch.float32)


def draws():
    return random.random(), float(numpy.random.rand()), torch.rand(3)


def plant_seen():
    return _plant_applied


def echo_kwargs(*args, **kwargs):
    return args, kwargs


def make_subgroup_and_sum():
    group = dist.new_group([0, 1])
    value = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(value, group=group)
    return int(value.item())


def set_grad_off():
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)


def grad_and_dtype():
    return torch.is_grad_enabled(), torch.get_default_dtype()


def test_results_come_back_in_rank_order(pool):
    results = pool.run(rank_and_world)
    assert [(r, w) for r, w, _ in results] == [(0, 2), (1, 2)]
    pids = [pid for _, _, pid in results]
    assert pids == pool.pids()
    assert os.getpid() not in pids


def test_collective_result_is_the_sum_over_ranks(pool):
    offset = 5
    expected = sum(rank + offset for rank in range(pool.world_size))
    assert pool.run(all_reduce_rank_plus, offset) == [expected] * pool.world_size


def test_args_and_kwargs_reach_every_rank_unchanged(pool):
    results = pool.run(echo_kwargs, 1, "two", key=[3, 4])
    assert results == [((1, "two"), {"key": [3, 4]})] * 2


def test_large_tensor_results_come_back_intact(pool):
    rows, cols = 4096, 2048  # 32 MiB per rank
    results = pool.run(ranked_tensor, rows, cols)
    for rank, tensor in enumerate(results):
        assert tensor.shape == (rows, cols)
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor, torch.full((rows, cols), float(rank)))


def test_same_seed_gives_same_draws_on_every_rank_and_every_call(pool):
    first = pool.run_seeded(1234, draws)
    again = pool.run_seeded(1234, draws)
    other = pool.run_seeded(1235, draws)
    random.seed(1234)
    numpy.random.seed(1234)
    torch.manual_seed(1234)
    local = (random.random(), float(numpy.random.rand()), torch.rand(3))
    for result in first + again:
        assert result[0] == local[0] and result[1] == local[1]
        assert torch.equal(result[2], local[2])
    assert other[0][0] != local[0]


def test_run_uses_the_pools_default_seed(pool):
    assert pool.run(draws)[0][0] == pool.run_seeded(pool.seed, draws)[0][0]


def test_planted_bugs_active_in_the_caller_are_applied_on_every_rank(pool, flag_plant):
    assert pool.run(plant_seen) == [False, False]
    with plants.applied([flag_plant]):
        assert pool.run(plant_seen) == [True, True]
    assert pool.run(plant_seen) == [False, False]


def test_subgroups_created_in_one_call_work_in_the_next(pool):
    assert pool.run(make_subgroup_and_sum) == [3, 3]
    assert pool.run(make_subgroup_and_sum) == [3, 3]


def test_grad_mode_and_default_dtype_are_reset_between_calls(pool):
    pool.run(set_grad_off)
    assert pool.run(grad_and_dtype) == [(True, torch.float32)] * 2


def test_unpicklable_function_is_refused_with_its_name(pool):
    with pytest.raises(HarnessError, match="not picklable"):
        pool.run(lambda: None)
    assert pool.run(all_reduce_rank_plus, 0) == [1.0, 1.0]


def test_cuda_pool_without_enough_gpus_is_refused():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs; the refusal cannot happen")
    with pytest.raises(HarnessError, match="needs one GPU per rank"):
        RankPool(2, device="cuda")


def test_closed_pool_refuses_calls_and_leaves_no_rank():
    pool = RankPool(1, preload=("torch",))
    assert pool.run(rank_and_world)[0][:2] == (0, 1)
    pids = pool.pids()
    pool.close()
    assert [pid for pid in pids if _is_running(pid)] == []
    with pytest.raises(HarnessError, match="closed"):
        pool.run(rank_and_world)


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def cuda_rank_tensor():
    value = torch.full((3,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(value)
    return value.device.index, value


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CUDA-only test: an nccl pool needs 2 CUDA devices")
def test_nccl_pool_puts_each_rank_on_its_own_gpu_and_returns_cpu_tensors():
    with RankPool(2, device="cuda", preload=("torch",)) as pool:
        assert pool.backend == "nccl"
        results = pool.run(cuda_rank_tensor)
    assert [index for index, _ in results] == [0, 1]
    for _, tensor in results:
        assert tensor.device.type == "cpu"
        assert torch.equal(tensor, torch.full((3,), 3.0))
