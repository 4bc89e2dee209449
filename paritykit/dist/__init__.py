"""Running a function on every rank: a pool of local rank processes, or the ranks of a torchrun launch.

``get_pool(world_size, device)`` returns the right one; both expose ``run``, ``run_seeded``,
``call``, ``pids``, ``wait_ready`` and ``close`` with the same meaning. ``PoolProvider`` keeps one
pool per world size for a whole run.
"""

from paritykit.dist.factory import get_pool
from paritykit.dist.launcher import LauncherGroup, launched_by_torchrun
from paritykit.dist.pool import RankPool
from paritykit.dist.provider import PoolProvider

__all__ = ["LauncherGroup", "PoolProvider", "RankPool", "get_pool", "launched_by_torchrun"]
