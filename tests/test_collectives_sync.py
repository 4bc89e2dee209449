"""torchrec's synchronous collectives: the sync cases really run them (every *_sync function of comm_ops
a placement needs, counted on the ranks), the default run none of them, and what they compute is the
unsharded model's (tests/test_dmp_cases.py runs the comparisons)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

from paritykit.checks.sharding.dmp_cases import dmp_cases, dmp_setup
from paritykit.engine.dmp_options import DmpOptions
from paritykit.engine.training import train_on_rank
from paritykit.errors import RankFailure
from paritykit.harness.patching import replaced

SYNC_FUNCTIONS = ("all2all_pooled_sync", "variable_batch_all2all_pooled_sync", "all2all_sequence_sync", "reduce_scatter_sync",
                  "reduce_scatter_base_sync", "reduce_scatter_v_sync", "all_gather_base_sync")


def _sync_calls(setup) -> dict[str, int]:
    """Train ``setup`` on this rank and count the calls of each of torchrec's *_sync collectives."""
    from torchrec.distributed import comm_ops

    counts = dict.fromkeys(SYNC_FUNCTIONS, 0)

    def counting(original, name):
        def counted(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return counted

    with contextlib.ExitStack() as stack:
        for name in SYNC_FUNCTIONS:
            stack.enter_context(replaced(comm_ops, name, lambda original, name=name: counting(original, name)))
        train_on_rank(setup)
    return {name: count for name, count in counts.items() if count}


def _sync_case(index: int):
    return [case for case in dmp_cases(2) if case.name == "sync-collectives"][index]


# What each pinned sync case's placements must run (per rank, 3 steps).
EXPECTED = {
    0: {"all2all_pooled_sync", "reduce_scatter_base_sync"},  # TW/CW pooled, RW reduce-scatter
    1: {"all2all_pooled_sync", "reduce_scatter_base_sync"},  # TWCW, GRID and TWRW
    2: {"variable_batch_all2all_pooled_sync", "reduce_scatter_v_sync"},  # a variable batch
    3: {"all2all_sequence_sync"},  # EC
    4: {"all2all_pooled_sync", "reduce_scatter_v_sync"},  # RW with a batch size per rank: uneven splits
}


UNEVEN = 4


@pytest.mark.world_size(2)
@pytest.mark.parametrize("index", sorted(EXPECTED))
def test_each_sync_case_runs_torchrecs_sync_collectives_and_the_default_runs_none(rank_pool, index):
    case = _sync_case(index)
    synced = rank_pool.run(_sync_calls, dmp_setup(case))
    assert [set(calls) for calls in synced] == [EXPECTED[index]] * 2, synced
    assert all(count >= 3 for calls in synced for count in calls.values())
    if index == UNEVEN:
        # The asynchronous path all-gathers uneven gradients: gloo refuses (known issue row-wise-family-uneven-batch).
        with pytest.raises(RankFailure, match="allgather"):
            rank_pool.run(_sync_calls, dmp_setup(dataclasses.replace(case, options=DmpOptions())))
        return
    plain = rank_pool.run(_sync_calls, dmp_setup(dataclasses.replace(case, options=DmpOptions())))
    assert plain == [{}, {}]
