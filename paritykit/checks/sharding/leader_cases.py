"""torchrec's collective control flow (``torchrec.distributed.collective_utils``) on the ranks, against
what it means, for every choice of the leader rank:

- ``is_leader(pg, leader)`` holds on the leader alone (leader 0 when none is given; with no group, a
  single process, only leader 0);
- ``invoke_on_rank_and_broadcast_result`` and a function wrapped by ``run_on_leader`` run once, on the
  leader, with the arguments given, and every rank gets the leader's result;
- ``create_on_rank_and_share_result`` creates once, on the leader, and every rank gets tensors equal
  to the leader's (a ``None`` kept as it is) in the leader's memory: a write there shows on every rank
  (each rank holds its result until all have read it, as a caller must: the memory lives with the
  leader's).

The group is the world, and on the pool of several hosts also strided subgroups ({0, 2} and {1, 3}, the
kind of group torchrec's intra- and cross-host groups are): there "the leader" is a rank of the group
(``pg.rank()``, as ``is_leader`` reads it), and every member gets the result made on its own group's
leader. A call that raises on a rank is that rank's result, so every rank goes on to the same collectives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from paritykit.errors import HarnessError, expect
from paritykit.harness.subgroups import STRIDED_GROUPS, STRIDED_WORLD_SIZE, group_of, own_group


@dataclass(frozen=True)
class LeaderCase:
    world_size: int
    leader: int  # a rank of the group
    # Each rank's process group: () the world, else groups of ranks covering it (dist.new_subgroups_by_enumeration).
    groups: tuple[tuple[int, ...], ...] = ()

    def case_id(self) -> str:
        on = f" groups={[list(g) for g in self.groups]}" if self.groups else ""
        return f"collective_utils leader={self.leader} world_size={self.world_size}{on}"

    def group_of(self, rank: int) -> tuple[int, ...]:
        return group_of(self.groups, rank, self.world_size)


def leader_cases(world_size: int) -> tuple[LeaderCase, ...]:
    return tuple(LeaderCase(world_size, leader) for leader in range(world_size))


def subgroup_leader_cases(world_size: int) -> tuple[LeaderCase, ...]:
    """Every leader of the strided groups of two ranks, on a pool of four (none on another size)."""
    if world_size != STRIDED_WORLD_SIZE:
        return ()
    return tuple(LeaderCase(world_size, leader, STRIDED_GROUPS) for leader in range(len(STRIDED_GROUPS[0])))


def _raised(exc: BaseException) -> dict[str, str]:
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "torchrec" in f.filename.split("/")]
    where = f" (in {frames[-1].filename.split('torchrec/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    first = re.sub(r" at 0x[0-9a-f]+", "", str(exc).splitlines()[0]) if str(exc) else ""  # no object addresses
    return {"raised": f"{type(exc).__name__}: {first}{where}"}


def _attempt(call: Any) -> Any:
    """The call's result, or what it raised (so that the other ranks are not left waiting in a collective)."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - compared in the caller like any wrong result
        return _raised(exc)


SHARED_WRITE = 100.0


def _created_on(rank: int, scale: float) -> tuple[torch.Tensor, None, torch.Tensor]:
    """What the creator makes: depends on the rank that runs it, so that a result made elsewhere shows."""
    return torch.arange(6, dtype=torch.float32).view(2, 3) * scale + rank, None, torch.tensor([rank, 7])


def run_leader_case_on_rank(case: LeaderCase) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed import collective_utils as cu

    rank = dist.get_rank()
    calls: list[str] = []

    def tagged(word: str, *, times: int) -> tuple[int, str]:
        calls.append(word)
        return rank, word * times

    with own_group(case.groups) as pg:
        found: dict[str, Any] = {
            "is_leader": cu.is_leader(pg, case.leader),
            "is_leader_default": cu.is_leader(pg),
            "is_leader_no_group": [cu.is_leader(None, leader) for leader in (0, 1)],
            "invoked": _attempt(lambda: cu.invoke_on_rank_and_broadcast_result(pg, case.leader, tagged, "ab", times=2)),
            "wrapped": _attempt(lambda: cu.run_on_leader(pg, case.leader)(tagged)("c", times=3)),
        }
        if hasattr(cu, "create_on_rank_and_share_result"):
            found.update(_shared_on_rank(case, pg, rank))
    found["calls"] = calls
    return found


def _shared_on_rank(case: LeaderCase, pg: Any, rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed import collective_utils as cu

    shared = _attempt(lambda: cu.create_on_rank_and_share_result(pg, case.leader, lambda scale: _created_on(rank, scale),
                                                                 list, tuple, 0.5))
    # Every rank holds its result (the leader's keeps the memory alive) until all have read it; then the
    # leader writes to its first tensor, which every rank must see: the memory is one, not a copy.
    made = not isinstance(shared, dict)
    dist.barrier()
    found: dict[str, Any] = {"shared": [None if t is None else t.clone() for t in shared] if made else shared}
    dist.barrier()
    if made and rank == case.group_of(rank)[case.leader]:
        shared[0].add_(SHARED_WRITE)
    dist.barrier()
    found["shared_after_write"] = shared[0].clone() if made else None
    dist.barrier()
    return found


def run_leader_case(case: LeaderCase, pool: Any) -> dict[str, Any]:
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    per_rank = pool.call(run_leader_case_on_rank, (case,), case=case.case_id())
    for rank, found in enumerate(per_rank):
        _check_rank(case, rank, found)
    return {"ranks": case.world_size, "leader": case.leader, "calls": 2 + ("shared" in per_rank[0])}


def _check_rank(case: LeaderCase, rank: int, found: dict[str, Any]) -> None:
    group = case.group_of(rank)
    position, leader = group.index(rank), group[case.leader]  # the leader as a rank of the world
    where = f"{case.case_id()}: rank {rank}" + (f" (rank {position} of group {list(group)})" if case.groups else "")
    expect(found["is_leader"] == (position == case.leader), f"{where}: is_leader(pg, {case.leader}) = {found['is_leader']}")
    expect(found["is_leader_default"] == (position == 0), f"{where}: is_leader(pg) = {found['is_leader_default']} (the leader defaults to rank 0)")
    expect(found["is_leader_no_group"] == [True, False], f"{where}: is_leader(None, 0/1) = {found['is_leader_no_group']} (no group: one process, rank 0)")
    expect(found["invoked"] == (leader, "abab"), f"{where}: invoke_on_rank_and_broadcast_result returned {found['invoked']!r}, "
                                                 f"expected the leader's (rank {leader}) result {(leader, 'abab')!r}")
    expect(found["wrapped"] == (leader, "ccc"), f"{where}: run_on_leader's wrapped call returned {found['wrapped']!r}, expected {(leader, 'ccc')!r}")
    expected_calls = ["ab", "c"] if rank == leader else []
    expect(found["calls"] == expected_calls, f"{where}: the function ran for {found['calls']}, expected {expected_calls} (only on the leader)")
    if "shared" not in found:
        return
    want = _created_on(leader, 0.5)
    shared = found["shared"]
    same = isinstance(shared, list) and len(shared) == len(want) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)) for a, b in zip(shared, want))
    expect(same, f"{where}: create_on_rank_and_share_result gave {shared}, expected the leader's {list(want)}")
    written = want[0] + SHARED_WRITE
    expect(torch.equal(found["shared_after_write"], written),
           f"{where}: after the leader added {SHARED_WRITE} to its shared tensor this rank reads {found['shared_after_write'].tolist()}, "
           f"expected {written.tolist()} (shared memory, not a copy)")
