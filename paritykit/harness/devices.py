"""The one place that turns "auto"/"cpu"/"cuda" into a device, a device into a backend, and a rank
into the device it computes on.

The CLI, the pytest plugin, the rank pool and the torchrun launcher group all resolve through here,
so "auto" means the same everywhere: CUDA when this host has a GPU for each of its ranks, else CPU.

On CUDA every rank of a host owns one GPU (its local rank) and the process group is nccl. Two ranks
on one GPU are refused before any rank starts: nccl itself refuses them at the first collective
("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ..."), and torchrec's own
multi-process tests never share a GPU between ranks either (they fall back to CPU ranks when there
are fewer GPUs than ranks). gloo with CUDA tensors is not offered as a fallback: it would test
gloo's CUDA path, which no torchrec deployment runs. With one GPU, CUDA runs world size 1.

``bind_rank`` is what each rank runs first, on CPU and CUDA alike, so that CPU CI exercises the
code path a GPU run takes.
"""

from __future__ import annotations

import os

from paritykit.errors import HarnessError

DEVICES = ("auto", "cpu", "cuda")
BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl"}


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def resolve_device(requested: str | None, ranks_per_host: int = 1, *, gpus: int | None = None) -> str:
    """"cpu" or "cuda" for ``requested`` (None or "auto" choose) when ``ranks_per_host`` ranks run on
    this host; HarnessError when CUDA is asked for and the host has fewer GPUs than ranks.

    ``gpus`` defaults to what torch sees; it is a parameter so that the rule can be stated and
    tested on machines without a GPU.
    """
    if requested is None:
        requested = "auto"
    if requested not in DEVICES:
        raise HarnessError(f"device must be one of {DEVICES}, got {requested!r}")
    if gpus is None:
        gpus = cuda_device_count()
    ranks = max(1, ranks_per_host)
    if requested == "auto":
        return "cuda" if gpus >= ranks else "cpu"
    if requested == "cuda" and gpus == 0 and ranks == 1:
        raise HarnessError("device 'cuda' was asked for, but torch sees no CUDA device on this machine")
    if requested == "cuda" and gpus < ranks:
        raise HarnessError(
            f"device 'cuda' with {ranks} ranks on this host needs one GPU per rank (nccl refuses two ranks "
            f"on one GPU); this machine has {gpus}: use a world size of at most {gpus} here, --device cpu, "
            "or torchrun across hosts"
        )
    return requested


def default_backend(device: str) -> str:
    """The process-group backend for a resolved device: nccl on CUDA, gloo on CPU."""
    try:
        return BACKEND_BY_DEVICE[device]
    except KeyError:
        raise HarnessError(f"a resolved device is 'cpu' or 'cuda', got {device!r}") from None


def bind_rank(device: str, local_rank: int, ranks_on_host: int):
    """Put this rank process on its device before it joins the process group; returns the torch.device.

    CUDA: the GPU ``local_rank``, with TF32 off (as torchrec's own multi-process tests do), so that
    a sharded result can be compared exactly with an unsharded one. CPU: the host's cores split
    between its ranks (more threads than cores only thrash).
    """
    import torch

    if device == "cuda":
        gpus = cuda_device_count()
        if local_rank >= gpus:
            raise HarnessError(f"local rank {local_rank} needs GPU {local_rank}, but this host has {gpus} GPUs")
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", local_rank)
    if device != "cpu":
        raise HarnessError(f"a rank runs on 'cpu' or 'cuda', got {device!r}")
    torch.set_num_threads(threads_per_rank(ranks_on_host))
    return torch.device("cpu")


def threads_per_rank(ranks_on_host: int) -> int:
    return max(1, host_cores() // max(1, ranks_on_host))


def rank_device(device: str):
    """The ``torch.device`` a rank computes on: its current GPU for "cuda", else the CPU."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise HarnessError("this rank was asked to run on CUDA but sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise HarnessError(f"a rank runs on 'cpu' or 'cuda', got {device!r}")
    return torch.device("cpu")


def collective_device(backend: str):
    """Where tensors handed to the process group's own collectives live: the rank's GPU under nccl."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
