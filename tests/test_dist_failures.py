"""RankPool under failure: an exception, a signal, an exit, a hang; each reported, then the next call works."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from paritykit.dist import RankPool
from paritykit.errors import ParityError, RankFailure

HANG_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, preload=("torch",), timeout=60) as pool:
        pool.wait_ready()
        yield pool


def rank_sum():
    value = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(value)
    return int(value.item())


def raise_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on rank {bad_rank}")
    return "fine"


def raise_on_rank_0_while_rank_1_waits_in_barrier():
    if dist.get_rank() == 0:
        raise ValueError("rank 0 gave up before the barrier")
    dist.barrier()


def parity_error_on_rank_1():
    if dist.get_rank() == 1:
        raise ParityError("output[3] differs: 1.0 vs 2.0")


def abort_on_rank_1():
    if dist.get_rank() == 1:
        os.abort()
    dist.barrier()


def exit_on_rank_0():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def sleep_on_rank_1_before_the_collective():
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def a_group_created_on_rank_0_only():
    if dist.get_rank() == 0:
        dist.new_group(ranks=[0])
    return "returned"


def a_group_of_every_rank():
    group = dist.new_group(ranks=list(range(dist.get_world_size())))
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    return int(value.item())


def assert_pool_works(pool):
    assert pool.run(rank_sum) == [3, 3]


def test_exception_on_one_rank_reports_its_traceback_and_the_other_ranks(pool):
    pids = pool.pids()
    with pytest.raises(RankFailure) as info:
        pool.call(raise_on_rank, (1,), case="exception-case")
    message = str(info.value)
    assert message.startswith("rank 1 raised ValueError: boom on rank 1")
    assert "--- rank 1 traceback ---" in message and "in raise_on_rank" in message
    assert "rank 0 returned normally" in message
    assert "exception-case" in message and "replay: " in message
    assert info.value.kind == "exception" and info.value.rank == 1
    # Both ranks returned in step: no reason to restart them.
    assert pool.pids() == pids
    assert_pool_works(pool)


def test_rank_stuck_in_a_collective_after_a_peer_failed_is_torn_down(pool):
    pids = pool.pids()
    with pytest.raises(RankFailure) as info:
        pool.run(raise_on_rank_0_while_rank_1_waits_in_barrier)
    message = str(info.value)
    assert message.startswith("rank 0 raised ValueError: rank 0 gave up before the barrier")
    assert "rank 1 was still running" in message
    assert "raise_on_rank_0_while_rank_1_waits_in_barrier" in info.value.stacks[1]
    assert "torn down" in message
    assert_pool_works(pool)
    assert set(pool.pids()).isdisjoint(pids)


def test_parity_error_on_a_rank_stays_a_parity_error(pool):
    with pytest.raises(ParityError) as info:
        pool.run(parity_error_on_rank_1)
    assert str(info.value).startswith("rank 1 raised ParityError: output[3] differs: 1.0 vs 2.0")
    assert_pool_works(pool)


def test_rank_killed_by_a_signal_is_reported_with_the_signal_and_the_case(pool):
    with pytest.raises(RankFailure) as info:
        pool.call(abort_on_rank_1, case="abort-case", seed=7)
    message = str(info.value)
    assert message.startswith("rank 1 was killed by SIGABRT during call #")
    assert "abort_on_rank_1 case 'abort-case' seed 7" in message
    assert info.value.kind == "signal"
    # faulthandler wrote the dying rank's stack.
    assert "abort_on_rank_1" in info.value.stacks[1]
    assert_pool_works(pool)


@pytest.mark.slow
def test_rank_that_exits_is_reported_with_its_exit_code(pool):
    with pytest.raises(RankFailure) as info:
        pool.run(exit_on_rank_0)
    assert str(info.value).startswith("rank 0 exited with code 3")
    assert info.value.kind == "exit"
    assert_pool_works(pool)


def test_hang_is_cut_at_the_timeout_with_the_stacks_of_all_ranks(pool):
    started = time.perf_counter()
    with pytest.raises(RankFailure) as info:
        pool.call(sleep_on_rank_1_before_the_collective, timeout=HANG_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    assert info.value.kind == "hang"
    assert str(info.value).startswith(f"ranks [0, 1] did not finish within {HANG_TIMEOUT_S:g} s")
    assert "sleep_on_rank_1_before_the_collective" in info.value.stacks[0]
    assert "sleep_on_rank_1_before_the_collective" in info.value.stacks[1]
    assert elapsed < HANG_TIMEOUT_S + 10
    assert_pool_works(pool)


def test_ranks_that_return_with_their_process_groups_out_of_step_fail_the_call_and_are_replaced(pool):
    # Left as they are, the next group every rank creates would pair up wrongly and hang in a later case.
    with pytest.raises(RankFailure, match=r"different numbers of process groups \(ranks 0-1: \[\d+, \d+\]\).*torn down"):
        pool.run(a_group_created_on_rank_0_only)
    assert pool.run(a_group_of_every_rank) == [2, 2]
    assert_pool_works(pool)
