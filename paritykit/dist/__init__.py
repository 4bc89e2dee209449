"""Running a function on every rank: a pool of local rank processes, or the ranks of a torchrun launch.

``get_pool(world_size, device)`` returns the right one; both expose ``run``, ``run_seeded``,
``call``, ``pids``, ``wait_ready``, ``close`` and ``is_reporting_rank`` with the same meaning.
``PoolProvider`` keeps one pool per world size (and hosts: ``ranks_per_host``) for a whole run. ``is_reporting_process()`` says
whether this process should print and write reports (under torchrun, rank 0 alone).
``resolve_device`` (the one device resolver) and ``host_cores`` come from
``paritykit.harness.devices``, re-exported for the pytest plugin and scripts that start pools.
"""

from paritykit.dist.factory import get_pool
from paritykit.dist.launcher import LauncherGroup, is_reporting_process, launched_by_torchrun
from paritykit.dist.pool import RankPool
from paritykit.dist.provider import PoolProvider
from paritykit.harness.devices import host_cores, resolve_device

__all__ = [
    "LauncherGroup", "PoolProvider", "RankPool", "get_pool", "is_reporting_process", "launched_by_torchrun",
    "host_cores", "resolve_device",
]
