"""torchrec's model delta tracker (checks/sharding/delta_tracker_cases.py): every case's reads match the
oracle from the plan and the batches on two ranks, and each way a read can be wrong is caught (the
ranks' reads changed: an id lost, an id of another window, a row from another step)."""

from __future__ import annotations

import copy

import pytest

from paritykit.checks.sharding.delta_tracker_cases import (compare_reads, run_tracker_case_on_rank, tracker_cases,
                                                          tracker_plan)
from paritykit.errors import ParityError

CASES = {case.mode + ("" if case.delete_on_read else "-kept") + ("-lagging" if case.mode == "EMBEDDING" and len(case.consumers) > 1 else ""): case
         for case in tracker_cases(2)}
_READS: dict[str, list] = {}


def _reads(rank_pool, name: str) -> list:
    """The ranks' reads of the case, asked once for every test below."""
    if name not in _READS:
        case = CASES[name]
        _READS[name] = rank_pool.call(run_tracker_case_on_rank, (case, tracker_plan(case)), case=case.case_id())
    return _READS[name]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_read_holds_the_ids_each_rank_looked_up_since_the_consumers_last_read(rank_pool, name):
    case = CASES[name]
    metrics = compare_reads(case, tracker_plan(case), _reads(rank_pool, name))
    assert metrics["ranks"] == 2 and metrics["reads"] == len(case.reads) and metrics["ids_compared"] > 20


def _lose_an_id(reads: list) -> str:
    fqn, (ids, states) = next((fqn, found) for fqn, found in reads[1][0].items() if len(found[0]) > 1)
    reads[1][0][fqn] = (ids[1:], states)
    return rf"rank 1, consumer 'publish' reading after step 1, {fqn}: ids"


def _read_everything_again(reads: list) -> str:
    # The snapshot consumer's second read (after step 4) given its first read's ids too: ids of another window.
    fqn = next(fqn for fqn in reads[0][3] if fqn in reads[0][1])
    reads[0][4][fqn] = (sorted(set(reads[0][4].get(fqn, ([], None))[0]) | set(reads[0][1][fqn][0]) | {10**6}), None)
    return rf"rank 0, consumer 'snapshot' reading after step 4, {fqn}: ids"


def _row_of_another_step(reads: list) -> str:
    fqn, (ids, states) = next(iter(reads[0][1].items()))
    reads[0][1][fqn] = (ids, [[value + 1.0 for value in states[0]]] + states[1:])
    return "its row at its first lookup in the window"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name,change", [("ID_ONLY", _lose_an_id), ("ID_ONLY-kept", _read_everything_again),
                                         ("EMBEDDING", _row_of_another_step)])
def test_a_wrong_read_is_caught(rank_pool, name, change):
    case, reads = CASES[name], copy.deepcopy(_reads(rank_pool, name))
    words = change(reads)
    with pytest.raises(ParityError, match=words):
        compare_reads(case, tracker_plan(case), reads)
