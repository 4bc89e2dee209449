"""RankPool: long-lived rank processes with an initialised process group, reused across calls.

Starting ranks costs seconds (interpreter, torch/torchrec import, process group); a call on
ranks that are already up costs well under a millisecond of pool overhead. A failed call
(exception, signal, hang) tears the ranks down when their state can no longer be trusted and
immediately starts a fresh set, so the next call works.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import sys
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable

from paritykit.dist import worker
from paritykit.dist.calls import DEFAULT_SEED, Call, RunShortcuts, function_name
from paritykit.dist.capacity import ensure_host_holds, record_rank_memory
from paritykit.dist.failures import FailedCall, RankOutcome
from paritykit.dist.messages import CallRequest, InitError, Raised, RankError, Returned
from paritykit.dist.ranks import Rank, death_signal_allowed, start_ranks, stop_ranks, take_stacks
from paritykit.dist.rendezvous import PoolDirectory
from paritykit.errors import HarnessError, RankFailure
from paritykit.harness.devices import cuda_device_count, default_backend, resolve_device
from paritykit.harness.hosts import gpus_by_host, host_layout

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torchrec")
# How long the other ranks get to finish after one rank failed, before their stacks are taken and
# the ranks rebuilt. Peers usually return within the same step, but on a loaded 2-core machine
# (pytest -n 4) a second was seen to be too short, which cost a needless rebuild.
DEFAULT_FAILURE_GRACE_S = 5.0

_live_pools: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


class RankPool(RunShortcuts):
    """``world_size`` rank processes in one process group, running picklable functions on demand.

    ``pool.run(fn, *args, **kwargs)`` runs ``fn`` on every rank with the pool's default seed and
    returns the per-rank results in rank order. ``pool.run_seeded(seed, fn, ...)`` seeds
    random/numpy/torch on every rank with ``seed`` first. ``pool.call(...)`` is the general form
    (seed, case label, timeout, replay string). Planted bugs active in the caller are applied on
    every rank. Tensors in results come back as CPU tensors.

    Any world size this host can hold is accepted: the ranks' memory (an estimate per rank times
    ``world_size`` against the available memory), open files, and on CUDA one GPU per rank
    (``paritykit.dist.capacity`` says how each is measured). A size that does not fit is refused
    with a HarnessError giving those numbers before any rank starts. Cores are shared, not a bound.

    ``ranks_per_host`` makes the pool stand for ``world_size // ranks_per_host`` hosts of that many
    ranks (None: one host). Each rank gets what torchrun would set for a launch of that shape
    (LOCAL_WORLD_SIZE, LOCAL_RANK = rank % ranks_per_host, GROUP_RANK = its host, RANK, WORLD_SIZE,
    the role's), so torchrec builds the intra- and cross-host process groups of a real multi-host
    launch and places table-row-wise and grid shards by host; on CUDA each host sees only its own
    GPUs. A ``ranks_per_host`` that does not divide ``world_size`` is a HarnessError before any rank
    starts. Plans for the pool are resolved with ``pool.ranks_per_host`` (docs/multihost.md).
    """

    # Only one process owns a local pool, so it is the one that reports (see LauncherGroup).
    is_reporting_rank = True

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        device: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        seed: int = DEFAULT_SEED,
        start_timeout: float | None = None,
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
        failure_grace_s: float = DEFAULT_FAILURE_GRACE_S,
        ranks_per_host: int | None = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise HarnessError(f"RankPool world_size must be a positive int, got {world_size!r}")
        if timeout <= 0:
            raise HarnessError(f"RankPool timeout must be positive, got {timeout!r}")
        self.world_size = world_size
        self.hosts = host_layout(world_size, ranks_per_host)
        self.ranks_per_host = self.hosts.ranks_per_host
        # All the ranks run on this machine, whatever hosts they stand for.
        self.device = resolve_device(device, ranks_per_host=world_size)
        ensure_host_holds(world_size, self.device)
        self.backend = backend or default_backend(self.device)
        self.timeout = float(timeout)
        self.seed = seed
        self.start_timeout = float(start_timeout) if start_timeout is not None else max(120.0, self.timeout)
        self.preload = tuple(preload)
        self.failure_grace_s = failure_grace_s
        self.generation = 0
        self.startup_s: float | None = None
        self._host_gpus = gpus_by_host(self.hosts, os.environ.get("CUDA_VISIBLE_DEVICES"), cuda_device_count()) \
            if self.device == "cuda" and self.hosts.hosts > 1 else None
        self._directory = PoolDirectory()
        self._ranks: list[Rank] | None = None
        self._ready = False
        self._closed = False
        self._started_at = 0.0
        self._lock = threading.Lock()
        self._call_ids = itertools.count(1)
        _live_pools.add(self)
        self._start()

    # -- public API -------------------------------------------------------------------------

    def call(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        seed: int | None = None,
        case: str | None = None,
        timeout: float | None = None,
        replay: str | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every rank. ``case`` names the case in failures; ``replay`` replaces the default replay string."""
        if self._closed:
            raise HarnessError("this RankPool is closed")
        call = Call(next(self._call_ids), fn, tuple(args), dict(kwargs or {}), self.seed if seed is None else seed, case)
        try:
            call_bytes = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise HarnessError(
                f"cannot send {function_name(fn)} to the ranks: the function or an argument is not picklable "
                f"(functions must be defined at module level): {exc}"
            ) from exc
        message = pickle.dumps(CallRequest(list(sys.path), call_bytes), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._ensure_ready()
            ranks = self._ranks
            try:
                for rank in ranks:
                    try:
                        rank.conn.send_bytes(message)
                    except OSError:
                        pass  # the rank is dead; collecting reports how it died
                collector = _Collector(ranks, self.failure_grace_s)
                outcome = collector.collect(timeout or self.timeout)
            except BaseException:
                # Interrupted (Ctrl-C) mid-call: the ranks are in an unknown state.
                if self._ranks is ranks:
                    self._teardown(restart=False)
                raise
            if isinstance(outcome, list):
                uneven = collector.uneven_group_counts()
                if uneven is None:
                    return outcome
                # Every rank returned, but torch now numbers the next process group differently on some
                # ranks: whatever creates one next (any later call) would pair ranks wrongly and hang.
                self._teardown(restart=True)
                raise RankFailure(
                    f"{call.describe()}: every rank returned, but the ranks have created different numbers of process "
                    f"groups (ranks 0-{self.world_size - 1}: {uneven}): torch numbers process groups in creation order, so "
                    "the next group created on every rank would pair ranks that number it differently and hang "
                    "(new_group must be entered by every rank). pool: ranks torn down; a fresh set "
                    f"(generation {self.generation}) is starting\nreplay: {replay or self._default_replay(call)}")
            failure = self._failed_call(call, outcome, timeout or self.timeout, replay)
        raise failure.to_exception()

    def wait_ready(self) -> float:
        """Block until every rank has joined the process group; returns the start-up time in seconds."""
        with self._lock:
            self._ensure_ready()
        return self.startup_s or 0.0

    def pids(self) -> list[int]:
        """Process ids of the current ranks (empty when none are running)."""
        return [rank.process.pid for rank in self._ranks or []]

    def close(self) -> None:
        """Stop every rank and remove the pool's files. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._stop_ranks(graceful=self._ready)
            self._directory.remove()
        _live_pools.discard(self)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        hosts = f", ranks_per_host={self.ranks_per_host}" if self.hosts.hosts > 1 else ""
        return f"RankPool(world_size={self.world_size}{hosts}, backend={self.backend!r}, device={self.device!r})"

    # -- starting and stopping ranks -------------------------------------------------------

    def _worker_spec(self, rank: int) -> worker.WorkerSpec:
        return worker.WorkerSpec(
            rank=rank,
            world_size=self.world_size,
            backend=self.backend,
            device=self.device,
            init_method=self._directory.init_method(self.generation),
            stack_file=str(self._directory.stack_file(self.generation, rank)),
            owner_pid=os.getpid(),
            arm_death_signal=death_signal_allowed(),
            preload=self.preload,
            timeout_s=self.timeout,
            ranks_per_host=self.ranks_per_host,
            visible_gpus=None if self._host_gpus is None else self._host_gpus[self.hosts.host_of(rank)],
        )

    def _start(self) -> None:
        self.generation += 1
        self._ranks = start_ranks([self._worker_spec(rank) for rank in range(self.world_size)])
        self._ready = False
        self._started_at = time.perf_counter()

    def _ensure_ready(self) -> None:
        if self._ranks is None:
            self._start()
        if self._ready:
            return
        deadline = self._started_at + self.start_timeout
        waiting = {rank.conn: rank for rank in self._ranks}
        sentinels = {rank.process.sentinel: rank for rank in self._ranks}
        while waiting:
            watched = list(waiting) + [s for s, r in sentinels.items() if r.conn in waiting]
            ready = wait(watched, deadline - time.perf_counter())
            if not ready:
                self._fail_start(f"ranks {sorted(r.rank for r in waiting.values())} did not start within {self.start_timeout:g} s")
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if rank.conn in waiting and not rank.conn.poll():
                        self._fail_start(_died_while_starting(rank))
                    continue
                rank = waiting.pop(obj)
                try:
                    reply = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    self._fail_start(_died_while_starting(rank))
                if isinstance(reply, InitError):
                    self._fail_start(f"rank {rank.rank} could not join the process group: {reply.error.traceback}")
                record_rank_memory(reply.peak_rss_bytes)
        self._ready = True
        self.startup_s = time.perf_counter() - self._started_at

    def _fail_start(self, reason: str) -> None:
        self._teardown(restart=False)
        hint = (
            "\n(ranks are spawned and import the main module: a script that creates a pool at its top "
            "level must do so under `if __name__ == \"__main__\":`; the rank's own error is on stderr above)"
        )
        raise HarnessError(f"{self!r} could not start: {reason}{hint}")

    def _stop_ranks(self, graceful: bool) -> None:
        ranks, self._ranks, self._ready = self._ranks, None, False
        if ranks:
            stop_ranks(ranks, graceful)

    def _teardown(self, restart: bool) -> None:
        self._stop_ranks(graceful=False)
        if restart and not self._closed:
            self._start()

    # -- a failed call -----------------------------------------------------------------------

    def _failed_call(self, call: Call, collected: "_Collector", timeout: float, replay: str | None) -> FailedCall:
        if collected.pending:
            take_stacks([collected.pending[r] for r in sorted(collected.pending)], collected.outcomes)
        if collected.ranks_consistent():
            note = "pool: every rank returned in step; the ranks were kept"
        else:
            self._teardown(restart=True)
            note = f"pool: ranks torn down; a fresh set (generation {self.generation}) is starting"
        kind, primary = collected.primary_failure()
        return FailedCall(kind, call.describe(), replay or self._default_replay(call), collected.outcomes, primary,
                          timeout, pool_note=note)

    def _default_replay(self, call: Call) -> str:
        case = f", case={call.case!r}" if call.case else ""
        carried = f"  # with {', '.join(repr(state) for _, state in call.contexts)}" if call.contexts else ""
        hosts = f", ranks_per_host={self.ranks_per_host}" if self.hosts.hosts > 1 else ""
        return (
            f"RankPool({self.world_size}{hosts}, backend={self.backend!r}, device={self.device!r})"
            f".call({function_name(call.fn)}, <args>, seed={call.seed}{case}){carried}"
        )


class _Collector:
    """Waits for one call's replies on every rank, noticing deaths, and a hang at the deadline."""

    def __init__(self, ranks: list[Rank], failure_grace_s: float) -> None:
        self.failure_grace_s = failure_grace_s
        self.results: list[Any] = [None] * len(ranks)
        self.outcomes = [RankOutcome(rank.rank, "running") for rank in ranks]
        self.failure_order: list[int] = []
        self.dist_states: dict[int, Any] = {}
        self.pending = {rank.rank: rank for rank in ranks}
        self._first_failure_at = 0.0
        self._by_object: dict[Any, tuple[str, Rank]] = {}
        for rank in ranks:
            self._by_object[rank.conn] = ("conn", rank)
            self._by_object[rank.process.sentinel] = ("process", rank)

    def collect(self, timeout: float) -> "list[Any] | _Collector":
        """The results in rank order, or this collector (holding what went wrong) on a failure."""
        started = time.perf_counter()
        while self.pending:
            limit = started + timeout
            if self.failure_order:
                limit = min(limit, self._first_failure_at + self.failure_grace_s)
            remaining = limit - time.perf_counter()
            if remaining <= 0:
                break
            watched = [obj for obj, (_, rank) in self._by_object.items() if rank.rank in self.pending]
            for obj in wait(watched, remaining):
                source, rank = self._by_object[obj]
                if rank.rank not in self.pending:
                    continue
                if source == "process" and rank.conn.poll():
                    continue  # read its last reply first
                self._record(rank, _receive(rank) if source == "conn" else None)
        return self if (self.pending or self.failure_order) else self.results

    def _record(self, rank: Rank, reply: Returned | Raised | None) -> None:
        outcome = self.outcomes[rank.rank]
        if reply is None:
            rank.process.join(1)
            code = rank.process.exitcode
            outcome.state, outcome.exitcode = ("killed" if (code or 0) < 0 else "exited"), code
            outcome.stack = rank.read_new_stack()
        elif isinstance(reply, Returned):
            record_rank_memory(reply.peak_rss_bytes)
            self.results[rank.rank] = reply.result
            outcome.state = "returned"
            self.dist_states[rank.rank] = reply.dist_state
        else:
            outcome.state, outcome.error = "raised", reply.error
            self.dist_states[rank.rank] = reply.dist_state
        del self.pending[rank.rank]
        if outcome.state != "returned":
            if not self.failure_order:
                self._first_failure_at = time.perf_counter()
            self.failure_order.append(rank.rank)

    def uneven_group_counts(self) -> list[int] | None:
        """Each rank's count of process groups created, when they differ (None when they agree). Only the
        count: a group a rank is not a member of is numbered but not kept, so the kept groups may differ."""
        counts = [self.dist_states[rank][0] for rank in sorted(self.dist_states)]
        return counts if len(set(counts)) > 1 else None

    def ranks_consistent(self) -> bool:
        """Every rank came back (returned or raised) with the same process-group state: safe to keep."""
        settled = not self.pending and all(o.state in ("returned", "raised") for o in self.outcomes)
        return settled and len(set(self.dist_states.values())) == 1

    def primary_failure(self) -> tuple[str, int | None]:
        # A rank that died is the cause; a peer's error in the same call (a gloo read error when the
        # connection dropped) is its consequence, even when it arrived first.
        died = [r for r in self.failure_order if self.outcomes[r].state in ("killed", "exited")]
        primary = (died or self.failure_order or [None])[0]
        if primary is None:
            return "hang", None
        return {"raised": "exception", "killed": "signal", "exited": "exit"}[self.outcomes[primary].state], primary


def _receive(rank: Rank) -> Returned | Raised | None:
    """The rank's reply, or None when its pipe closed because it died."""
    try:
        data = rank.conn.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        return pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - a result class this process cannot import
        return Raised(-1, RankError("exception", f"its result could not be unpickled in the parent: {exc!r}", repr(exc)), None)


def _died_while_starting(rank: Rank) -> str:
    rank.process.join(1)
    return f"rank {rank.rank} died while starting (exit code {rank.process.exitcode})\n{rank.read_new_stack()}"


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close()
