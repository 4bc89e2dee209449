"""get_pool: the launcher's ranks under torchrun, a local RankPool otherwise."""

from __future__ import annotations

from paritykit.dist.launcher import LauncherGroup, launched_by_torchrun
from paritykit.dist.pool import DEFAULT_TIMEOUT_S, RankPool

_launcher_group: LauncherGroup | None = None


def get_pool(world_size: int, device: str | None = None, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> RankPool | LauncherGroup:
    """Ranks to run checks on. Under torchrun, ``world_size`` must equal the launch's WORLD_SIZE."""
    global _launcher_group
    if not launched_by_torchrun():
        return RankPool(world_size, backend=backend, device=device, timeout=timeout)
    if _launcher_group is None:
        _launcher_group = LauncherGroup(backend=backend, device=device, timeout=max(timeout, 600.0))
    if world_size != _launcher_group.world_size:
        from paritykit.errors import HarnessError

        raise HarnessError(
            f"under torchrun the ranks are the launcher's (WORLD_SIZE={_launcher_group.world_size}); "
            f"a check asked for world size {world_size}: run it with --world-size {_launcher_group.world_size}"
        )
    return _launcher_group
