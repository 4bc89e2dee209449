"""The ranks of a torchrun launch (torch.distributed.elastic) behind RankPool's API.

Under torchrun every rank runs the whole check script, so ``run(fn, ...)`` runs ``fn`` locally
on each rank and gathers every rank's pickled result with ``all_gather``: each rank gets the
same list, in rank order, and control flow stays identical on all ranks (a failure on one rank
raises on every rank). Reports should be written by the rank where ``is_reporting_rank`` is true.
Crashes and hangs are the launcher's to handle: torchrun tears the launch down when a rank dies,
and collectives give up after ``timeout``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

from paritykit.dist.calls import DEFAULT_SEED, Call, RunShortcuts, dumps_with_cpu_tensors, execute, rank_error_from
from paritykit.dist.failures import FailedCall, RankOutcome
from paritykit.dist.messages import Raised, Returned
from paritykit.errors import HarnessError
from paritykit.harness.devices import default_backend, resolve_device

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in LAUNCHER_VARIABLES)


class LauncherGroup(RunShortcuts):
    """The launcher's process group, used like a RankPool. Create through ``get_pool``."""

    def __init__(self, backend: str | None = None, device: str | None = None, timeout: float = 600.0, *, seed: int = DEFAULT_SEED) -> None:
        import torch
        import torch.distributed as dist

        if not launched_by_torchrun():
            missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
            raise HarnessError(f"LauncherGroup needs a torchrun launch; missing environment variables {missing}")
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.device = resolve_device(device)
        self.backend = backend or default_backend(self.device)
        self.timeout = float(timeout)
        self.seed = seed
        self.is_reporting_rank = self.rank == 0
        self._call_ids = itertools.count(1)
        if self.device == "cuda":
            if torch.cuda.device_count() <= self.local_rank:
                raise HarnessError(
                    f"rank {self.rank} has LOCAL_RANK {self.local_rank} but this host has "
                    f"{torch.cuda.device_count()} GPUs"
                )
            torch.cuda.set_device(self.local_rank)
        if not dist.is_initialized():
            dist.init_process_group(self.backend, init_method="env://", timeout=timedelta(seconds=self.timeout))
            atexit.register(_destroy_process_group)

    def call(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        seed: int | None = None,
        case: str | None = None,
        timeout: float | None = None,
        replay: str | None = None,
    ) -> list[Any]:
        """Same meaning as RankPool.call; ``timeout`` is the process group's, fixed at launch."""
        call = Call(next(self._call_ids), fn, tuple(args), dict(kwargs or {}), self.seed if seed is None else seed, case)
        try:
            reply: Returned | Raised = Returned(call.call_id, execute(call), (0, 0))
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather below
            reply = Raised(call.call_id, rank_error_from(exc), None)
        try:
            payload = dumps_with_cpu_tensors(reply)
        except Exception as exc:  # noqa: BLE001
            payload = pickle.dumps(Raised(call.call_id, rank_error_from(exc), None))
        replies = [pickle.loads(data) for data in self._all_gather_bytes(payload)]
        if all(isinstance(r, Returned) for r in replies):
            return [r.result for r in replies]
        outcomes = [
            RankOutcome(rank, "returned") if isinstance(r, Returned) else RankOutcome(rank, "raised", error=r.error)
            for rank, r in enumerate(replies)
        ]
        primary = next(o.rank for o in outcomes if o.state == "raised")
        replay = replay or f"torchrun ... (rank {self.rank} of {self.world_size}) .call({call.describe()})"
        raise FailedCall("exception", call.describe(), replay, outcomes, primary, self.timeout).to_exception()

    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order; returns once the backend has let go of the tensors.

        Not ``dist.all_gather_object``: gloo's worker thread drops its references to a collective's
        tensors some time after ``wait()`` returns. Tensors made in Python whose Python side is gone
        by then need the GIL to be freed; if that happens while the interpreter is finalizing (the
        last collective of a rank that exits at once, common under CPU load), the worker thread is
        killed while unwinding and the rank aborts with "terminate called without an active
        exception", so torchrun fails the launch and the other hosts' agents wait out their exit
        barrier. Here the tensors are ours, and we wait (GIL released) until the worker freed them.
        """
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        size = torch.tensor([len(payload)], dtype=torch.long, device=device)
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        lengths = [int(length.item()) for length in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        outputs = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(self.world_size)]
        dist.all_gather(outputs, padded)
        gathered = [output[:length].cpu().numpy().tobytes() for output, length in zip(outputs, lengths)]
        handed_over = [weakref.ref(tensor) for tensor in (size, *sizes, padded, *outputs)]
        del size, sizes, padded, outputs
        deadline = time.monotonic() + self.timeout
        while any(ref() is not None for ref in handed_over) and time.monotonic() < deadline:
            time.sleep(0.001)
        return gathered

    def pids(self) -> list[int]:
        return [os.getpid()]

    def wait_ready(self) -> float:
        return 0.0

    def close(self) -> None:
        """Nothing to stop: the launcher owns the ranks and the process group lives until exit."""

    def __enter__(self) -> "LauncherGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LauncherGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
