"""The one place that turns "auto"/"cpu"/"cuda" into a device, and a device into a backend.

The CLI, the pytest plugin, the rank pool and the torchrun launcher group all resolve through here,
so "auto" means the same everywhere: CUDA when there are enough GPUs for one per rank, else CPU.
"""

from __future__ import annotations

from paritykit.errors import HarnessError

DEVICES = ("auto", "cpu", "cuda")


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(requested: str | None, ranks_per_host: int = 1) -> str:
    """"cpu" or "cuda" for ``requested`` (None or "auto" choose); HarnessError when CUDA is asked
    for and there is no GPU (ranks sharing one GPU are allowed only where the caller says so)."""
    if requested is None:
        requested = "auto"
    if requested not in DEVICES:
        raise HarnessError(f"device must be one of {DEVICES}, got {requested!r}")
    gpus = cuda_device_count()
    if requested == "auto":
        return "cuda" if gpus >= max(1, ranks_per_host) else "cpu"
    if requested == "cuda" and gpus < ranks_per_host and ranks_per_host > 1:
        raise HarnessError(
            f"device 'cuda' with {ranks_per_host} ranks on this host needs one GPU per rank; this machine has {gpus}"
        )
    if requested == "cuda" and gpus == 0:
        raise HarnessError("device 'cuda' was asked for, but torch sees no CUDA device on this machine")
    return requested


def default_backend(device: str) -> str:
    """The process-group backend for a resolved device: nccl on CUDA, gloo on CPU."""
    return "nccl" if device == "cuda" else "gloo"


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
