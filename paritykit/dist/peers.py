"""Under torchrun: where every rank runs (host, pid), and which of them are gone when a collective breaks.

A rank that dies (a signal, an exit, an exception outside any call) closes its gloo/nccl
connections, and every peer's next collective fails with a connection error that names an address,
not a rank. The ranks exchange their host name and pid once, at start, so that a rank whose
collective broke can say which ranks on its own host are gone; a rank on another host is the
launcher's to report there (torchrun prints the failed rank with its exit code or signal).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    pid: int

    def where(self) -> str:
        return f"pid {self.pid} on {self.host}"


def this_process(rank: int) -> Peer:
    return Peer(rank, socket.gethostname(), os.getpid())


def gone_on_this_host(peers: list[Peer], wait_s: float = 0.0) -> list[Peer]:
    """The peers that ran on this host and whose process no longer exists (or is a zombie).

    Waits up to ``wait_s`` for a first one to be gone: a killed process closes its sockets before
    it has finished exiting, so a peer may see the connection break a moment before.
    """
    host = socket.gethostname()
    local = [peer for peer in peers if peer.host == host]
    deadline = time.monotonic() + wait_s
    while True:
        gone = [peer for peer in local if not process_alive(peer.pid)]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def other_hosts(peers: list[Peer]) -> list[str]:
    host = socket.gethostname()
    return sorted({peer.host for peer in peers if peer.host != host})


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: kill(0) said it exists
