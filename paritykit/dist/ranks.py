"""The rank processes of a RankPool: starting them, asking them for their stacks, stopping them."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from paritykit.dist import worker
from paritykit.dist.failures import RankOutcome
from paritykit.dist.messages import STOP

_STACK_DUMP_WAIT_S = 2.0
_JOIN_WAIT_S = 5.0
# A rank asked to stop normally exits at once; one that does not is killed after this.
_GRACEFUL_STOP_S = 1.0


@dataclass
class Rank:
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


def start_ranks(specs: list[worker.WorkerSpec]) -> list[Rank]:
    """Spawn one worker per spec (spawn: forking after torch has started threads is unsafe)."""
    context = multiprocessing.get_context("spawn")
    ranks = []
    for spec in specs:
        parent_conn, child_conn = context.Pipe(duplex=True)
        lifeline_reader, lifeline_writer = context.Pipe(duplex=False)
        process = context.Process(
            target=worker.main, args=(spec, child_conn, lifeline_reader), name=f"paritykit-rank{spec.rank}", daemon=True
        )
        process.start()
        # Only the rank may hold its ends: EOF must reach it when this process dies.
        child_conn.close()
        lifeline_reader.close()
        ranks.append(Rank(spec.rank, process, parent_conn, lifeline_writer, spec.stack_file))
    return ranks


def death_signal_allowed() -> bool:
    """PR_SET_PDEATHSIG fires when the starting *thread* exits, so only arm it from the main thread."""
    return threading.current_thread() is threading.main_thread()


def stop_ranks(ranks: list[Rank], graceful: bool) -> None:
    """Ask the ranks to stop (graceful), kill any that do not, and wait for all of them."""
    if graceful:
        for rank in ranks:
            try:
                rank.conn.send_bytes(STOP)
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


def take_stacks(ranks: list[Rank], outcomes: list[RankOutcome]) -> None:
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


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
