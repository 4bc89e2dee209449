"""Workers end themselves when the process that owns their pool is gone.

Two mechanisms, because each covers a case the other misses:
- a pipe whose other end only the owner holds: when the owner dies for any reason (even
  SIGKILL) the kernel closes it and a watchdog thread in the worker reads EOF and exits;
- on Linux, PR_SET_PDEATHSIG, which works even while the worker holds the GIL in native code.
  It fires when the *thread* that started the worker exits, so it is only armed for pools
  started from the main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

_PR_SET_PDEATHSIG = 1


def arm_parent_death_signal(owner_pid: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The owner may have died before prctl took effect.
    if os.getppid() != owner_pid:
        os._exit(1)


def watch_lifeline(lifeline: Connection) -> None:
    def wait_for_owner_death() -> None:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        # os._exit: the owner is gone, nothing is left to report to, and a normal exit could
        # block on a process group that will never finish.
        os._exit(0)

    threading.Thread(target=wait_for_owner_death, name="paritykit-lifeline", daemon=True).start()
