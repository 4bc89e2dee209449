"""PoolProvider: one pool of ranks per (world size, backend), kept for a whole gate run or test session."""

from __future__ import annotations

from typing import Any

from paritykit.dist.factory import get_pool
from paritykit.dist.pool import DEFAULT_TIMEOUT_S


class PoolProvider:
    """Hands out one pool per world size (and backend), started on first use and closed together."""

    def __init__(self, device: str = "cpu", timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.device = device
        self.timeout = timeout
        self._pools: dict[tuple[int, str | None], Any] = {}

    def get(self, world_size: int, backend: str | None = None):
        """A local RankPool, or the launcher's ranks when running under torchrun.

        ``backend`` None means the device's default (gloo on CPU, nccl on CUDA).
        """
        pool = self._pools.get((world_size, backend))
        if pool is None:
            pool = get_pool(world_size, device=self.device, backend=backend, timeout=self.timeout)
            self._pools[(world_size, backend)] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> "PoolProvider":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
