"""PoolProvider: one pool of ranks per (world size, ranks per host, backend), kept for a whole gate run or test session."""

from __future__ import annotations

from typing import Any

from paritykit.dist.factory import get_pool
from paritykit.dist.launcher import launched_by_torchrun
from paritykit.dist.pool import DEFAULT_TIMEOUT_S


class PoolProvider:
    """Hands out one pool per world size, ranks per host and backend, started on first use and closed together."""

    def __init__(self, device: str = "cpu", timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.device = device
        self.timeout = timeout
        self._pools: dict[tuple[int, int | None, str | None], Any] = {}

    def get(self, world_size: int, backend: str | None = None, *, ranks_per_host: int | None = None):
        """A local RankPool, or the launcher's ranks when running under torchrun.

        ``backend`` None means the device's default (gloo on CPU, nccl on CUDA). ``ranks_per_host``
        None means one host for a local pool, and the launch's hosts under torchrun.
        """
        if ranks_per_host == world_size and not launched_by_torchrun():
            ranks_per_host = None  # one host either way: one pool
        key = (world_size, ranks_per_host, backend)
        pool = self._pools.get(key)
        if pool is None:
            pool = get_pool(world_size, device=self.device, backend=backend, timeout=self.timeout, ranks_per_host=ranks_per_host)
            self._pools[key] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> "PoolProvider":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
