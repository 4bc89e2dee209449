"""The ranks of a torchrun launch (torch.distributed.elastic) behind RankPool's API.

Under torchrun every rank runs the whole check script, so ``run(fn, ...)`` runs ``fn`` locally
on each rank and gathers every rank's pickled result with ``all_gather``: each rank gets the
same list, in rank order, and control flow stays identical on all ranks (a failure on one rank
raises on every rank). Reports should be written by the rank where ``is_reporting_rank`` is true.
A rank that dies makes every peer's next gather fail: the peers raise a RankFailure naming the
ranks gone from their host (the launcher on the dead rank's host reports its signal or exit code),
refuse every later call at once, and so finish promptly instead of waiting out ``timeout``.
An exception that escapes a rank's script is written where torchrun looks for it
(TORCHELASTIC_ERROR_FILE), so the launcher's failure summary carries its traceback.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import sys
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable

from paritykit.dist.calls import DEFAULT_SEED, Call, RunShortcuts, dumps_with_cpu_tensors, execute, rank_error_from
from paritykit.dist.failures import FailedCall, RankOutcome
from paritykit.dist.messages import Raised, Returned
from paritykit.dist.peers import Peer, gone_on_this_host, other_hosts, this_process
from paritykit.errors import HarnessError, RankFailure
from paritykit.harness.devices import bind_rank, collective_device, default_backend, resolve_device
from paritykit.harness.hosts import POOL_RANK_VARIABLE, HostLayout, host_layout
from paritykit.harness.plans import local_world_size

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# A killed rank's connections close while its process is still exiting: how long a peer that saw
# the connection break waits for that process to be gone before it reports.
PEER_EXIT_GRACE_S = 5.0


def launched_by_torchrun() -> bool:
    """Whether this process is a worker of a torchrun launch (a rank of paritykit's own pool, which
    carries the same variables for torchrec's sake, is not)."""
    return all(name in os.environ for name in LAUNCHER_VARIABLES) and POOL_RANK_VARIABLE not in os.environ


def is_reporting_process() -> bool:
    """Whether this process prints and writes reports: always outside torchrun, only rank 0 under it."""
    return not launched_by_torchrun() or os.environ.get("RANK") == "0"


class LauncherGroup(RunShortcuts):
    """The launcher's process group, used like a RankPool. Create through ``get_pool``."""

    def __init__(self, backend: str | None = None, device: str | None = None, timeout: float = 600.0, *, seed: int = DEFAULT_SEED) -> None:
        import torch.distributed as dist

        if not launched_by_torchrun():
            missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
            raise HarnessError(f"LauncherGroup needs a torchrun launch; missing environment variables {missing}")
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        # The launch's hosts as torchrec groups them (one host when LOCAL_WORLD_SIZE does not divide the world).
        self.hosts: HostLayout = host_layout(self.world_size, local_world_size(self.world_size))
        self.ranks_per_host = self.hosts.ranks_per_host
        self.device = resolve_device(device, ranks_per_host=ranks_on_host)
        self.backend = backend or default_backend(self.device)
        self.timeout = float(timeout)
        self.seed = seed
        self.is_reporting_rank = self.rank == 0
        self._call_ids = itertools.count(1)
        self._lost: str | None = None
        _report_uncaught_exceptions_to_the_launcher()
        bind_rank(self.device, self.local_rank, ranks_on_host)
        if not dist.is_initialized():
            dist.init_process_group(self.backend, init_method="env://", timeout=timedelta(seconds=self.timeout))
            atexit.register(_destroy_process_group)
        self.peers: list[Peer] = [pickle.loads(data) for data in self._all_gather_bytes(pickle.dumps(this_process(self.rank)))]

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
        if self._lost is not None:
            raise RankFailure(f"not run: {call.describe()}; the launch lost a rank earlier: {self._lost}")
        try:
            reply: Returned | Raised = Returned(call.call_id, execute(call), (0, 0))
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather below
            reply = Raised(call.call_id, rank_error_from(exc), None)
            # Said at once: if the peers wait in a collective this rank left, the gather never comes.
            print(f"paritykit rank {self.rank}: {call.describe()[:300]} raised (the launch reports it once every rank "
                  f"reaches the next gather):\n{''.join(traceback.format_exception(exc)).rstrip()}", file=sys.stderr, flush=True)
        try:
            payload = dumps_with_cpu_tensors(reply)
        except Exception as exc:  # noqa: BLE001
            payload = pickle.dumps(Raised(call.call_id, rank_error_from(exc), None))
        try:
            gathered = self._all_gather_bytes(payload)
        except RuntimeError as exc:  # torch.distributed.DistBackendError and gloo's own errors
            raise self._lost_a_rank(call, exc, replay) from exc
        replies = [pickle.loads(data) for data in gathered]
        if all(isinstance(r, Returned) for r in replies):
            return [r.result for r in replies]
        outcomes = [
            RankOutcome(rank, "returned") if isinstance(r, Returned) else RankOutcome(rank, "raised", error=r.error)
            for rank, r in enumerate(replies)
        ]
        primary = next(o.rank for o in outcomes if o.state == "raised")
        replay = replay or f"torchrun ... (rank {self.rank} of {self.world_size}) .call({call.describe()})"
        raise FailedCall("exception", call.describe(), replay, outcomes, primary, self.timeout).to_exception()

    def _lost_a_rank(self, call: Call, exc: BaseException, replay: str | None) -> Exception:
        """The gather of ``call`` broke: a peer is gone. Name the ones gone from this host; refuse later calls."""
        gone = gone_on_this_host(self.peers, wait_s=PEER_EXIT_GRACE_S)
        here = this_process(self.rank).host
        outcomes = [
            RankOutcome(peer.rank, "gone" if peer in gone else "alive" if peer.host == here else "unknown", where=peer.where())
            for peer in self.peers
        ]
        outcomes[self.rank] = RankOutcome(self.rank, "raised", error=rank_error_from(exc), where=self.peers[self.rank].where())
        elsewhere = other_hosts(self.peers)
        note = "the launcher on the host of a gone rank reports its exit code or signal"
        if not gone:
            hosts = f": look at the launchers on {', '.join(elsewhere)}" if elsewhere else ""
            note = f"no rank on this host is gone within {PEER_EXIT_GRACE_S:g} s of the broken connection{hosts}"
        failure = FailedCall(
            "lost", call.describe(), replay or f"torchrun ... .call({call.describe()})", outcomes, None, self.timeout,
            pool_note=note,
        )
        self._lost = failure.headline()
        return failure.to_exception()

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

        device = collective_device(self.backend)
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
        return f"LauncherGroup(rank={self.rank}, world_size={self.world_size}, hosts={self.hosts}, backend={self.backend!r})"


def _report_uncaught_exceptions_to_the_launcher() -> None:
    """Chain an excepthook that records an escaping exception in torchrun's error file (the same
    as torch.distributed.elastic's @record), so the launcher's summary shows the traceback."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE") or getattr(sys.excepthook, "_paritykit", False):
        return
    previous = sys.excepthook

    def record_then_print(exc_type, exc, tb):  # noqa: ANN001 - sys.excepthook's signature
        try:
            raise exc.with_traceback(tb)  # record_exception formats the exception being handled
        except BaseException:  # noqa: BLE001
            try:
                from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

                ErrorHandler().record_exception(exc)
            except Exception:  # noqa: BLE001 - the traceback still goes to stderr below
                pass
        previous(exc_type, exc, tb)

    record_then_print._paritykit = True  # type: ignore[attr-defined]
    sys.excepthook = record_then_print


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
