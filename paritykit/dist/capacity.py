"""How many ranks this host can hold: memory, open files and (on CUDA) GPUs, never a fixed number.

A RankPool's ranks are processes on this host. What bounds them:
- memory: each rank holds an interpreter with torch and torchrec imported, plus what its calls
  build. The estimate per rank is the largest of ``DEFAULT_RANK_MEMORY_BYTES`` (a rank's peak
  resident memory measured running the gate's checks, see below) and the peak any rank of a pool
  in this process has reported so far (each rank reports its peak with every reply), so a suite
  with heavier models raises the estimate for the pools it starts later. The host's available
  memory is MemAvailable, or the cgroup's limit minus its usage when that is lower.
- open files: the owner holds three descriptors per rank (pipe, lifeline, process sentinel) and
  each gloo rank one socket per peer; both must fit under the soft RLIMIT_NOFILE.
- GPUs, on CUDA: one per rank (``paritykit.harness.devices.resolve_device`` says why).
Cores are not a bound: ranks share them (``threads_per_rank``), which is slower, never wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from paritykit.errors import HarnessError
from paritykit.harness.devices import cuda_device_count, host_cores, resolve_device

GIB = 1024**3
# A rank's peak resident memory was 0.33 GiB after importing torch and torchrec, and 0.37 GiB after
# the gate's td-kjt, cw-stitch, pipeline and sync checks at world size 2 (torchrec 1.8, CPU; the
# command is in docs/multihost.md). The default leaves a third more for larger draws.
DEFAULT_RANK_MEMORY_BYTES = GIB // 2
# Descriptors a process needs beyond the ranks' (the interpreter, torch's libraries, pytest).
FILE_DESCRIPTOR_RESERVE = 256
DESCRIPTORS_PER_RANK_IN_OWNER = 3

_peak_rank_memory = 0


@dataclass(frozen=True)
class HostResources:
    """What this host offers to a pool's ranks; None where the operating system does not say."""

    memory_available_bytes: int | None
    memory_source: str
    open_files_limit: int | None
    cores: int
    gpus: int


def measure_host() -> HostResources:
    memory, source = _available_memory()
    return HostResources(memory, source, _open_files_limit(), host_cores(), cuda_device_count())


def record_rank_memory(peak_bytes: int) -> None:
    """Remember a rank's reported peak resident memory (the pool calls this with every reply)."""
    global _peak_rank_memory
    _peak_rank_memory = max(_peak_rank_memory, int(peak_bytes))


def rank_memory_estimate() -> int:
    return max(DEFAULT_RANK_MEMORY_BYTES, _peak_rank_memory)


def ensure_host_holds(world_size: int, device: str, host: HostResources | None = None,
                      rank_memory_bytes: int | None = None) -> None:
    """HarnessError, with the numbers, when ``world_size`` ranks on ``device`` do not fit this host."""
    host = host or measure_host()
    per_rank = rank_memory_bytes or rank_memory_estimate()
    if device == "cuda":
        resolve_device("cuda", ranks_per_host=world_size, gpus=host.gpus)
    problems = []
    needed = world_size * per_rank
    if host.memory_available_bytes is not None and needed > host.memory_available_bytes:
        problems.append(
            f"memory: {world_size} ranks x {per_rank / GIB:.2f} GiB per rank = {needed / GIB:.1f} GiB, "
            f"but {host.memory_available_bytes / GIB:.1f} GiB is available ({host.memory_source}); "
            f"at most {host.memory_available_bytes // per_rank} ranks fit"
        )
    descriptors = max(DESCRIPTORS_PER_RANK_IN_OWNER * world_size, world_size) + FILE_DESCRIPTOR_RESERVE
    if host.open_files_limit is not None and descriptors > host.open_files_limit:
        problems.append(
            f"open files: {world_size} ranks need about {descriptors} descriptors, but the soft limit "
            f"(ulimit -n) is {host.open_files_limit}"
        )
    if problems:
        raise HarnessError(
            f"this host cannot hold a pool of {world_size} ranks on {device}: " + "; ".join(problems)
            + " (run fewer ranks here, or spread them over hosts with torchrun: docs/multihost.md)"
        )


def _available_memory() -> tuple[int | None, str]:
    candidates = []
    meminfo = _meminfo_available()
    if meminfo is not None:
        candidates.append((meminfo, "MemAvailable in /proc/meminfo"))
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        candidates.append((cgroup, "the cgroup's memory.max minus memory.current"))
    if not candidates:
        return None, "unknown"
    return min(candidates)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def _open_files_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def peak_resident_bytes() -> int:
    """This process's peak resident memory (VmHWM), 0 where /proc does not say; each rank reports it."""
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


def describe_host(host: HostResources | None = None) -> str:
    """The host's numbers and how many ranks they hold, for people deciding on a world size."""
    host = host or measure_host()
    per_rank = rank_memory_estimate()
    memory = "unknown" if host.memory_available_bytes is None else f"{host.memory_available_bytes / GIB:.1f} GiB"
    fit = "no memory bound" if host.memory_available_bytes is None else f"{host.memory_available_bytes // per_rank} ranks"
    return (
        f"memory available  {memory} ({host.memory_source})\n"
        f"open files limit  {host.open_files_limit or 'unlimited'}\n"
        f"cores             {host.cores}\n"
        f"GPUs              {host.gpus}\n"
        f"per rank          {per_rank / GIB:.2f} GiB (estimate)\n"
        f"memory holds      {fit} (CUDA: also at most {host.gpus}, one GPU per rank)"
    )
