"""RankPool: long-lived rank processes with an initialised process group, reused across calls.

Starting ranks costs seconds (interpreter, torch/torchrec import, process group); a call on
ranks that are already up costs well under a millisecond of pool overhead. A failed call
(exception, signal, hang) tears the ranks down when their state can no longer be trusted and
immediately starts a fresh set, so the next call works.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import os
import pickle
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from paritykit import plants
from paritykit.dist import worker
from paritykit.dist.calls import DEFAULT_SEED, Call, RankError, RunShortcuts, function_name
from paritykit.dist.failures import FailedCall, RankOutcome
from paritykit.dist.rendezvous import PoolDirectory
from paritykit.errors import HarnessError

MAX_WORLD_SIZE = 4
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torchrec")
# How long the other ranks get to finish after one rank failed, before their stacks are taken and
# the ranks rebuilt. Peers usually return within the same step, but on a loaded 2-core machine
# (pytest -n 4) a second was seen to be too short, which cost a needless rebuild.
DEFAULT_FAILURE_GRACE_S = 5.0
_STACK_DUMP_WAIT_S = 2.0
_JOIN_WAIT_S = 5.0
# A rank asked to stop normally exits at once; one that does not is killed after this.
_GRACEFUL_STOP_S = 1.0

_live_pools: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


@dataclass
class _Rank:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: Connection
    lifeline: Connection
    stack_file: str
    stack_offset: int = 0

    def read_new_stack(self) -> str:
        try:
            with open(self.stack_file, "rb") as handle:
                handle.seek(self.stack_offset)
                data = handle.read()
        except OSError:
            return ""
        self.stack_offset += len(data)
        return data.decode(errors="replace")


def resolve_device(device: str | None, world_size: int) -> str:
    """None picks cuda when there is one GPU per rank, else cpu."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"
    if device not in ("cpu", "cuda"):
        raise HarnessError(f"RankPool device must be 'cpu', 'cuda' or None, got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise HarnessError(
            f"RankPool(world_size={world_size}, device='cuda') needs one GPU per rank; "
            f"this machine has {torch.cuda.device_count()}"
        )
    return device


class RankPool(RunShortcuts):
    """``world_size`` rank processes in one process group, running picklable functions on demand.

    ``pool.run(fn, *args, **kwargs)`` runs ``fn`` on every rank with the pool's default seed and
    returns the per-rank results in rank order. ``pool.run_seeded(seed, fn, ...)`` seeds
    random/numpy/torch on every rank with ``seed`` first. ``pool.call(...)`` is the general form
    (seed, case label, timeout, replay string). Planted bugs active in the caller are applied on
    every rank. Tensors in results come back as CPU tensors.
    """

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
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise HarnessError(f"RankPool world_size must be an int from 1 to {MAX_WORLD_SIZE}, got {world_size!r}")
        if timeout <= 0:
            raise HarnessError(f"RankPool timeout must be positive, got {timeout!r}")
        self.world_size = world_size
        self.device = resolve_device(device, world_size)
        self.backend = backend or ("nccl" if self.device == "cuda" else "gloo")
        self.timeout = float(timeout)
        self.seed = seed
        self.start_timeout = float(start_timeout) if start_timeout is not None else max(120.0, self.timeout)
        self.preload = tuple(preload)
        self.failure_grace_s = failure_grace_s
        self.generation = 0
        self.startup_s: float | None = None
        self._directory = PoolDirectory()
        self._ranks: list[_Rank] | None = None
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
        call = Call(
            call_id=next(self._call_ids),
            fn=fn,
            args=tuple(args),
            kwargs=dict(kwargs or {}),
            seed=self.seed if seed is None else seed,
            plants=plants.active(),
            case=case,
        )
        try:
            call_bytes = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise HarnessError(
                f"cannot send {function_name(fn)} to the ranks: the function or an argument is not picklable "
                f"(functions must be defined at module level): {exc}"
            ) from exc
        message = pickle.dumps((list(sys.path), call_bytes), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._ensure_ready()
            ranks = self._ranks
            try:
                for rank in ranks:
                    try:
                        rank.conn.send_bytes(message)
                    except OSError:
                        pass  # the rank is dead; collecting reports how it died
                outcome = self._collect(call, ranks, timeout or self.timeout, replay or self._default_replay(call))
            except BaseException:
                # Interrupted (Ctrl-C) mid-call: the ranks are in an unknown state.
                if self._ranks is ranks:
                    self._teardown(restart=False)
                raise
        if isinstance(outcome, FailedCall):
            raise outcome.to_exception()
        return outcome

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
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, device={self.device!r})"

    # -- starting and stopping ranks -------------------------------------------------------

    def _start(self) -> None:
        self.generation += 1
        # spawn: forking after torch has started threads is unsafe.
        context = multiprocessing.get_context("spawn")
        arm_death_signal = threading.current_thread() is threading.main_thread()
        ranks = []
        for rank in range(self.world_size):
            spec = worker.WorkerSpec(
                rank=rank,
                world_size=self.world_size,
                backend=self.backend,
                device=self.device,
                init_method=self._directory.init_method(self.generation),
                stack_file=str(self._directory.stack_file(self.generation, rank)),
                owner_pid=os.getpid(),
                arm_death_signal=arm_death_signal,
                preload=self.preload,
                timeout_s=self.timeout,
                num_threads=max(1, (os.cpu_count() or 1) // self.world_size),
            )
            parent_conn, child_conn = context.Pipe(duplex=True)
            lifeline_reader, lifeline_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=worker.main,
                args=(spec, child_conn, lifeline_reader),
                name=f"paritykit-rank{rank}",
                daemon=True,
            )
            process.start()
            # Only the rank may hold its ends: EOF must reach it when this process dies.
            child_conn.close()
            lifeline_reader.close()
            ranks.append(_Rank(rank, process, parent_conn, lifeline_writer, spec.stack_file))
        self._ranks = ranks
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
            ready = wait(list(waiting) + [s for s, r in sentinels.items() if r.conn in waiting], deadline - time.perf_counter())
            if not ready:
                self._fail_start(f"ranks {sorted(r.rank for r in waiting.values())} did not start within {self.start_timeout:g} s")
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if rank.conn in waiting and not rank.conn.poll():
                        rank.process.join(1)
                        self._fail_start(f"rank {rank.rank} died while starting (exit code {rank.process.exitcode})\n{rank.read_new_stack()}")
                    continue
                rank = waiting.pop(obj)
                try:
                    reply = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    rank.process.join(1)
                    self._fail_start(f"rank {rank.rank} died while starting (exit code {rank.process.exitcode})\n{rank.read_new_stack()}")
                if reply[0] == "init-error":
                    self._fail_start(f"rank {rank.rank} could not join the process group: {reply[1].traceback}")
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
        if not ranks:
            return
        if graceful:
            for rank in ranks:
                try:
                    rank.conn.send_bytes(b"")
                except OSError:
                    pass
            deadline = time.perf_counter() + _GRACEFUL_STOP_S
            for rank in ranks:
                rank.process.join(max(0.0, deadline - time.perf_counter()))
        for rank in ranks:
            if rank.process.is_alive():
                rank.process.kill()
        for rank in ranks:
            rank.process.join(_JOIN_WAIT_S)
            rank.conn.close()
            rank.lifeline.close()

    def _teardown(self, restart: bool) -> None:
        self._stop_ranks(graceful=False)
        if restart and not self._closed:
            self._start()

    # -- collecting one call ---------------------------------------------------------------

    def _collect(self, call: Call, ranks: list[_Rank], timeout: float, replay: str) -> list[Any] | FailedCall:
        started = time.perf_counter()
        results: list[Any] = [None] * len(ranks)
        outcomes = [RankOutcome(rank.rank, "running") for rank in ranks]
        failure_order: list[int] = []
        dist_states: dict[int, Any] = {}
        pending = {rank.rank: rank for rank in ranks}
        first_failure_at = 0.0
        by_object: dict[Any, tuple[str, _Rank]] = {}
        for rank in ranks:
            by_object[rank.conn] = ("conn", rank)
            by_object[rank.process.sentinel] = ("process", rank)

        while pending:
            limit = started + timeout
            if failure_order:
                limit = min(limit, first_failure_at + self.failure_grace_s)
            remaining = limit - time.perf_counter()
            if remaining <= 0:
                break
            watched = [obj for obj, (_, rank) in by_object.items() if rank.rank in pending]
            for obj in wait(watched, remaining):
                source, rank = by_object[obj]
                if rank.rank not in pending:
                    continue
                if source == "process" and rank.conn.poll():
                    continue  # read its last reply first
                reply = self._receive(rank) if source == "conn" else None
                if reply is None:
                    rank.process.join(1)
                    code = rank.process.exitcode
                    outcome = outcomes[rank.rank]
                    outcome.state, outcome.exitcode = ("killed" if (code or 0) < 0 else "exited"), code
                    outcome.stack = rank.read_new_stack()
                elif reply[0] == "ok":
                    results[rank.rank] = reply[2]
                    outcomes[rank.rank].state = "returned"
                    dist_states[rank.rank] = reply[3]
                else:
                    outcomes[rank.rank].state, outcomes[rank.rank].error = "raised", reply[2]
                    dist_states[rank.rank] = reply[3]
                del pending[rank.rank]
                if outcomes[rank.rank].state != "returned":
                    if not failure_order:
                        first_failure_at = time.perf_counter()
                    failure_order.append(rank.rank)

        if not pending and not failure_order:
            return results
        if pending:
            self._take_stacks([pending[r] for r in sorted(pending)], outcomes)
        consistent = not pending and all(o.state in ("returned", "raised") for o in outcomes)
        consistent = consistent and len(set(dist_states.values())) == 1
        if consistent:
            note = "pool: every rank returned in step; the ranks were kept"
        else:
            self._teardown(restart=True)
            note = f"pool: ranks torn down; a fresh set (generation {self.generation}) is starting"
        # A rank that died is the cause; a peer's error in the same call (a gloo read error when the
        # connection dropped) is its consequence, even when it arrived first.
        died = [r for r in failure_order if outcomes[r].state in ("killed", "exited")]
        primary = (died or failure_order or [None])[0]
        kind = "hang" if primary is None else {"raised": "exception", "killed": "signal", "exited": "exit"}[outcomes[primary].state]
        return FailedCall(kind, call.describe(), replay, outcomes, primary, timeout, pool_note=note)

    def _receive(self, rank: _Rank) -> tuple | None:
        """The rank's reply, or None when its pipe closed because it died."""
        try:
            data = rank.conn.recv_bytes()
        except (EOFError, OSError):
            return None
        try:
            return pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - a result class this process cannot import
            error = RankError("exception", f"its result could not be unpickled in the parent: {exc!r}", repr(exc))
            return ("error", -1, error, None)

    def _take_stacks(self, ranks: list[_Rank], outcomes: list[RankOutcome]) -> None:
        """Ask each rank for the Python stacks of all its threads (faulthandler) and wait for them."""
        sizes = {}
        for rank in ranks:
            sizes[rank.rank] = _file_size(rank.stack_file)
            try:
                os.kill(rank.process.pid, worker.STACK_DUMP_SIGNAL)
            except OSError:
                pass
        deadline = time.perf_counter() + _STACK_DUMP_WAIT_S
        while time.perf_counter() < deadline:
            if all(_file_size(rank.stack_file) > sizes[rank.rank] for rank in ranks):
                time.sleep(0.05)  # let the last lines land
                break
            time.sleep(0.01)
        for rank in ranks:
            outcomes[rank.rank].stack = rank.read_new_stack() or "(no stack: the rank did not answer the dump signal)"

    def _default_replay(self, call: Call) -> str:
        case = f", case={call.case!r}" if call.case else ""
        planted = f"  # with plants {list(call.plants)} applied" if call.plants else ""
        return (
            f"RankPool({self.world_size}, backend={self.backend!r}, device={self.device!r})"
            f".call({function_name(call.fn)}, <args>, seed={call.seed}{case}){planted}"
        )


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close()
