"""How the ranks of a run are grouped into hosts, as torchrun tells torchrec.

torchrec reads the hosts from LOCAL_WORLD_SIZE (``torchrec.distributed.comm.get_local_size``):
table-row-wise and grid shards spread over one host's ranks, the sharding_plan generators place
them by host index, and TWRW/GRID build an intra-host and a cross-host process group
(``intra_and_cross_node_pg``). A torchrun launch of H hosts x R ranks gives rank ``r`` host
``r // R`` and local rank ``r % R`` (its agents hand out global ranks host by host).

    layout = HostLayout(hosts=2, ranks_per_host=2)    # world size 4; str(layout) == "2x2"
    layout.torchrun_environment(3)                   # {"LOCAL_RANK": "1", "GROUP_RANK": "1", ...}
    host_layout(4, 2)                                # validated: HarnessError when 2 does not divide 4
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from paritykit.errors import HarnessError

# What torchrun's agent sets for each worker about the launch's shape (torch.distributed.elastic's
# local_elastic_agent), besides the rendezvous address and restart bookkeeping. torchrec reads
# LOCAL_WORLD_SIZE and LOCAL_RANK; torch's env:// rendezvous reads RANK and WORLD_SIZE.
TORCHRUN_TOPOLOGY_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
)
TORCHRUN_DEFAULT_ROLE = "default"
# Set in the ranks of a paritykit RankPool, which carry torchrun's variables too: they are not a
# torchrun launch's workers (paritykit.dist.launched_by_torchrun says no).
POOL_RANK_VARIABLE = "PARITYKIT_POOL_RANK"


@dataclass(frozen=True)
class HostLayout:
    """``hosts`` hosts of ``ranks_per_host`` ranks each; ranks are numbered host by host."""

    hosts: int
    ranks_per_host: int

    def __post_init__(self) -> None:
        for name in ("hosts", "ranks_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HarnessError(f"a host layout's {name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_host

    def ranks_of_host(self, host: int) -> tuple[int, ...]:
        return tuple(range(host * self.ranks_per_host, (host + 1) * self.ranks_per_host))

    def torchrun_environment(self, rank: int) -> dict[str, str]:
        """The topology variables torchrun would set for ``rank`` of a launch of this shape."""
        values = {
            "RANK": rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank(rank),
            "LOCAL_WORLD_SIZE": self.ranks_per_host, "GROUP_RANK": self.host_of(rank), "GROUP_WORLD_SIZE": self.hosts,
            "ROLE_RANK": rank, "ROLE_WORLD_SIZE": self.world_size, "ROLE_NAME": TORCHRUN_DEFAULT_ROLE,
        }
        return {name: str(values[name]) for name in TORCHRUN_TOPOLOGY_VARIABLES}

    def describe(self) -> str:
        if self.hosts == 1:
            return f"one host of {self.ranks_per_host} ranks"
        return f"{self.hosts} hosts x {self.ranks_per_host} ranks"

    def __str__(self) -> str:
        return f"{self.hosts}x{self.ranks_per_host}"

    @classmethod
    def parse(cls, text: str) -> "HostLayout":
        """"2x2" (hosts x ranks per host); HarnessError naming the text otherwise."""
        hosts, sep, ranks = text.strip().lower().partition("x")
        if not sep or not hosts.isdigit() or not ranks.isdigit():
            raise HarnessError(f"a host layout is HOSTSxRANKS_PER_HOST such as 2x2, got {text!r}")
        return cls(int(hosts), int(ranks))


def host_layout(world_size: int, ranks_per_host: int | None = None) -> HostLayout:
    """The layout of ``world_size`` ranks with ``ranks_per_host`` per host (None: one host).

    HarnessError when ``ranks_per_host`` is not a positive divisor of ``world_size``: torchrec gives
    every host the same number of ranks (it divides the world by LOCAL_WORLD_SIZE).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise HarnessError(f"world_size must be a positive int, got {world_size!r}")
    if ranks_per_host is None:
        return HostLayout(1, world_size)
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or ranks_per_host < 1:
        raise HarnessError(f"ranks_per_host must be a positive int, got {ranks_per_host!r}")
    if world_size % ranks_per_host:
        raise HarnessError(
            f"ranks_per_host={ranks_per_host} does not divide world size {world_size}: every host holds the same "
            f"number of ranks (torchrec divides the world by LOCAL_WORLD_SIZE); divisors of {world_size}: "
            f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    return HostLayout(world_size // ranks_per_host, ranks_per_host)


def ranks_per_host_of_this_launch(world_size: int) -> int | None:
    """The ranks per host this process was started with (a torchrun launch, or a rank of a pool that
    stands for several hosts) when it is a launch of ``world_size`` ranks whose LOCAL_WORLD_SIZE
    divides it; None otherwise (the caller of a pool, a process outside any launch)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    same_launch = os.environ.get("WORLD_SIZE") == str(world_size)
    if same_launch and local.isdigit() and 0 < int(local) <= world_size and world_size % int(local) == 0:
        return int(local)
    return None


def gpus_by_host(layout: HostLayout, visible: str | None, gpu_count: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each host of ``layout`` on one machine: consecutive slices of the
    GPUs this process sees (``visible``, as inherited, else all ``gpu_count``), one per rank."""
    gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible else [str(i) for i in range(gpu_count)]
    if len(gpus) < layout.world_size:
        raise HarnessError(f"{layout.describe()} on CUDA needs {layout.world_size} GPUs (one per rank); "
                           f"this process sees {len(gpus)}")
    return [",".join(gpus[host * layout.ranks_per_host:(host + 1) * layout.ranks_per_host]) for host in range(layout.hosts)]
