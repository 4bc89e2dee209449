"""The loop each rank of a RankPool runs: join the process group once, then run calls until told to stop.

Messages in both directions are the named ones of ``paritykit.dist.messages``.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from paritykit.dist import lifeline as lifeline_mod
from paritykit.dist.calls import add_to_sys_path, dumps_with_cpu_tensors, execute, rank_error_from
from paritykit.dist.capacity import peak_resident_bytes
from paritykit.dist.messages import STOP, CallRequest, InitError, Raised, Ready, Returned
from paritykit.harness import line_coverage
from paritykit.harness.devices import bind_rank
from paritykit.harness.hosts import POOL_RANK_VARIABLE, HostLayout
from paritykit.harness.noise import quiet_known_noise

# Sent by the parent to ask a rank for the Python stacks of all its threads.
STACK_DUMP_SIGNAL = signal.SIGUSR1


@dataclass
class WorkerSpec:
    rank: int
    world_size: int
    backend: str
    device: str
    init_method: str
    stack_file: str
    owner_pid: int
    arm_death_signal: bool
    preload: tuple[str, ...]
    timeout_s: float
    # The hosts the pool stands for (world_size: one host), and on CUDA the GPUs of this rank's host
    # (CUDA_VISIBLE_DEVICES; None: leave it as inherited).
    ranks_per_host: int = 0
    visible_gpus: str | None = None

    @property
    def hosts(self) -> HostLayout:
        ranks = self.ranks_per_host or self.world_size
        return HostLayout(self.world_size // ranks, ranks)


def main(spec: WorkerSpec, conn: Connection, lifeline: Connection) -> None:
    # Ctrl-C in a terminal reaches the whole process group; the parent decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.arm_death_signal:
        lifeline_mod.arm_parent_death_signal(spec.owner_pid)
    lifeline_mod.watch_lifeline(lifeline)
    stack_file = open(spec.stack_file, "w", buffering=1)
    # Fatal signals (SIGABRT, SIGSEGV...) write this rank's stack before it dies; the parent's
    # dump signal writes it on request (hangs, or when a peer failed).
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack_file, all_threads=True, chain=False)

    started = time.perf_counter()
    line_coverage.start_in_rank()  # before torchrec is imported, when `paritykit coverage` asked
    quiet_known_noise()
    try:
        _init_process_group(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure to start is reported, not raised
        conn.send_bytes(pickle.dumps(InitError(rank_error_from(exc))))
        return
    conn.send_bytes(pickle.dumps(Ready(os.getpid(), time.perf_counter() - started, peak_resident_bytes())))
    _serve(conn)
    _shutdown()


def announce_hosts(spec: WorkerSpec) -> None:
    """Tell torchrec what torchrun would for a launch of the pool's hosts (one host unless the pool
    stands for several): LOCAL_WORLD_SIZE, LOCAL_RANK, GROUP_RANK, RANK, WORLD_SIZE and the role's.

    torchrec reads LOCAL_WORLD_SIZE and LOCAL_RANK (torchrec.distributed.comm.get_local_size) to group
    ranks into hosts; without them it logs "Could not determine LOCAL_WORLD_SIZE" on every sharded
    module and assumes 8 ranks per host. POOL_RANK_VARIABLE keeps paritykit from taking this rank
    for a torchrun worker. On CUDA each host sees only its own GPUs, as on separate machines.
    """
    os.environ.update(spec.hosts.torchrun_environment(spec.rank))
    os.environ[POOL_RANK_VARIABLE] = "1"
    if spec.visible_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_gpus


def _init_process_group(spec: WorkerSpec) -> None:
    announce_hosts(spec)
    for module in spec.preload:
        importlib.import_module(module)
    from datetime import timedelta

    import torch.distributed as dist

    # The GPU is the local rank's among the host's; the cores are this machine's, shared by all ranks.
    bind_rank(spec.device, local_rank=spec.hosts.local_rank(spec.rank), ranks_on_host=spec.world_size)
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )


def _serve(conn: Connection) -> None:
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        if message == STOP:
            return
        request: CallRequest = pickle.loads(message)
        call_id = -1
        try:
            add_to_sys_path(request.sys_path)
            call = pickle.loads(request.call_bytes)
            call_id = call.call_id
            payload = dumps_with_cpu_tensors(Returned(call_id, execute(call), dist_state(), peak_resident_bytes()))
        except BaseException as exc:  # noqa: BLE001 - the parent decides; this rank stays up
            payload = pickle.dumps(Raised(call_id, rank_error_from(exc), dist_state(), peak_resident_bytes()))
        conn.send_bytes(payload)
        del payload


def dist_state() -> tuple[int, int]:
    """What must agree across ranks for the pool to stay usable: sub-groups created so far."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    return (world.group_count, len(world.pg_map))


def _shutdown() -> None:
    import torch.distributed as dist

    line_coverage.save_in_rank()

    if dist.is_initialized():
        dist.destroy_process_group()
