"""Where the ranks of one pool meet: a FileStore in a directory private to that pool.

A file rendezvous needs no port at all, so pools of concurrent pytest workers and of several
pytest runs on one machine cannot collide. gloo and nccl then open their own connections on
ports the kernel hands out (port 0), which cannot collide either.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from paritykit.dist.peers import process_alive


PREFIX = "paritykit-pool-"


class PoolDirectory:
    """A fresh temporary directory per pool: one store file per generation, one stack file per rank.

    Its name carries the owner's pid, so that directories left by owners that were killed (and
    could not clean up) are removed by the next pool created on the machine.
    """

    def __init__(self) -> None:
        remove_directories_of_dead_owners()
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))

    def init_method(self, generation: int) -> str:
        # A new file per generation: a store left behind by killed ranks is never reused.
        return f"file://{self.path / f'store-{generation}'}"

    def stack_file(self, generation: int, rank: int) -> Path:
        return self.path / f"stacks-{generation}-rank{rank}.txt"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def remove_directories_of_dead_owners() -> None:
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        owner = path.name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not process_alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)
