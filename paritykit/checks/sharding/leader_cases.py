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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.errors import HarnessError, expect


@dataclass(frozen=True)
class LeaderCase:
    world_size: int
    leader: int

    def case_id(self) -> str:
        return f"collective_utils leader={self.leader} world_size={self.world_size}"


def leader_cases(world_size: int) -> tuple[LeaderCase, ...]:
    return tuple(LeaderCase(world_size, leader) for leader in range(world_size))


SHARED_WRITE = 100.0


def _created_on(rank: int, scale: float) -> tuple[torch.Tensor, None, torch.Tensor]:
    """What the creator makes: depends on the rank that runs it, so that a result made elsewhere shows."""
    return torch.arange(6, dtype=torch.float32).view(2, 3) * scale + rank, None, torch.tensor([rank, 7])


def run_leader_case_on_rank(case: LeaderCase) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.distributed import collective_utils as cu

    pg, rank = dist.group.WORLD, dist.get_rank()
    calls: list[str] = []

    def tagged(word: str, *, times: int) -> tuple[int, str]:
        calls.append(word)
        return rank, word * times

    found: dict[str, Any] = {
        "is_leader": cu.is_leader(pg, case.leader),
        "is_leader_default": cu.is_leader(pg),
        "is_leader_no_group": [cu.is_leader(None, leader) for leader in (0, 1)],
        "invoked": cu.invoke_on_rank_and_broadcast_result(pg, case.leader, tagged, "ab", times=2),
        "wrapped": cu.run_on_leader(pg, case.leader)(tagged)("c", times=3),
    }
    if hasattr(cu, "create_on_rank_and_share_result"):
        shared = cu.create_on_rank_and_share_result(pg, case.leader, lambda scale: _created_on(rank, scale),
                                                    list, tuple, 0.5)
        # Every rank holds its result (the leader's keeps the memory alive) until all have read it; then the
        # leader writes to its first tensor, which every rank must see: the memory is one, not a copy.
        dist.barrier()
        found["shared"] = [None if t is None else t.clone() for t in shared]
        dist.barrier()
        if rank == case.leader:
            shared[0].add_(SHARED_WRITE)
        dist.barrier()
        found["shared_after_write"] = shared[0].clone()
        dist.barrier()
    found["calls"] = calls
    return found


def run_leader_case(case: LeaderCase, pool: Any) -> dict[str, Any]:
    if pool.world_size != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, the pool has {pool.world_size}")
    leader = case.leader
    per_rank = pool.call(run_leader_case_on_rank, (case,), case=case.case_id())
    for rank, found in enumerate(per_rank):
        where = f"{case.case_id()}: rank {rank}"
        expect(found["is_leader"] == (rank == leader), f"{where}: is_leader(pg, {leader}) = {found['is_leader']}")
        expect(found["is_leader_default"] == (rank == 0), f"{where}: is_leader(pg) = {found['is_leader_default']} (the leader defaults to rank 0)")
        expect(found["is_leader_no_group"] == [True, False], f"{where}: is_leader(None, 0/1) = {found['is_leader_no_group']} (no group: one process, rank 0)")
        expect(found["invoked"] == (leader, "abab"), f"{where}: invoke_on_rank_and_broadcast_result returned {found['invoked']!r}, "
                                                       f"expected the leader's (rank {leader}) result {(leader, 'abab')!r}")
        expect(found["wrapped"] == (leader, "ccc"), f"{where}: run_on_leader's wrapped call returned {found['wrapped']!r}, expected {(leader, 'ccc')!r}")
        expected_calls = ["ab", "c"] if rank == leader else []
        expect(found["calls"] == expected_calls, f"{where}: the function ran for {found['calls']}, expected {expected_calls} (only on the leader)")
        if "shared" in found:
            want = _created_on(leader, 0.5)
            same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)) for a, b in zip(found["shared"], want))
            expect(len(found["shared"]) == len(want) and same,
                    f"{where}: create_on_rank_and_share_result gave {found['shared']}, expected the leader's {list(want)}")
            written = want[0] + SHARED_WRITE
            expect(torch.equal(found["shared_after_write"], written),
                    f"{where}: after the leader added {SHARED_WRITE} to its shared tensor this rank reads {found['shared_after_write'].tolist()}, "
                    f"expected {written.tolist()} (shared memory, not a copy)")
    return {"ranks": case.world_size, "leader": leader, "calls": 2 + ("shared" in per_rank[0])}
