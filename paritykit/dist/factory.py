"""get_pool: the launcher's ranks under torchrun, a local RankPool otherwise."""

from __future__ import annotations

from paritykit.dist.launcher import LauncherGroup, launched_by_torchrun
from paritykit.dist.pool import DEFAULT_TIMEOUT_S, RankPool
from paritykit.errors import HarnessError
from paritykit.harness.hosts import host_layout

_launcher_group: LauncherGroup | None = None


def get_pool(world_size: int, device: str | None = None, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
             *, ranks_per_host: int | None = None) -> RankPool | LauncherGroup:
    """Ranks to run checks on. Under torchrun, ``world_size`` must equal the launch's WORLD_SIZE and
    ``ranks_per_host`` (when given) its LOCAL_WORLD_SIZE: the hosts are the launch's. Otherwise a pool
    of ``world_size`` ranks standing for hosts of ``ranks_per_host`` ranks (None: one host)."""
    global _launcher_group
    if not launched_by_torchrun():
        return RankPool(world_size, backend=backend, device=device, timeout=timeout, ranks_per_host=ranks_per_host)
    if _launcher_group is None:
        _launcher_group = LauncherGroup(backend=backend, device=device, timeout=max(timeout, 600.0))
    if world_size != _launcher_group.world_size:
        raise HarnessError(
            f"under torchrun the ranks are the launcher's (WORLD_SIZE={_launcher_group.world_size}); "
            f"a check asked for world size {world_size}: run it with --world-size {_launcher_group.world_size}"
        )
    if ranks_per_host is not None and host_layout(world_size, ranks_per_host) != _launcher_group.hosts:
        raise HarnessError(
            f"under torchrun the hosts are the launch's ({_launcher_group.hosts.describe()}, LOCAL_WORLD_SIZE="
            f"{_launcher_group.ranks_per_host}); a check asked for {host_layout(world_size, ranks_per_host).describe()}: "
            "run it with --hosts none (the launch's own hosts are used) or launch that shape"
        )
    return _launcher_group
