"""get_pool under torchrun: the launcher's ranks behind RankPool's API, on one and on two 'hosts'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from paritykit.dist import LauncherGroup, RankPool, get_pool, launched_by_torchrun
from paritykit.errors import HarnessError

LAUNCH_TIMEOUT_S = 180

# Run by every rank of the launch. Rank 0 writes what the checks under test would report.
RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from paritykit.dist import LauncherGroup, get_pool
    from paritykit.errors import RankFailure

    def rank_plus_one_summed():
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return dist.get_rank(), value.item()

    def draw():
        return torch.rand(4)

    def fail_on_last_rank():
        if dist.get_rank() == dist.get_world_size() - 1:
            raise ValueError("last rank fails")
        return "ok"

    pool = get_pool(int(os.environ["WORLD_SIZE"]), device="cpu")
    assert isinstance(pool, LauncherGroup), pool
    summed = pool.run(rank_plus_one_summed)
    draws = pool.run_seeded(99, draw)
    try:
        pool.run(fail_on_last_rank)
        failure = None
    except RankFailure as exc:
        failure = str(exc)
    after_failure = pool.run(rank_plus_one_summed)
    try:
        get_pool(pool.world_size + 1)
        mismatch = None
    except Exception as exc:
        mismatch = f"{type(exc).__name__}: {exc}"
    if pool.is_reporting_rank:
        with open(sys.argv[1], "w") as out:
            json.dump({
                "world_size": pool.world_size,
                "summed": summed,
                "draws": [t.tolist() for t in draws],
                "failure": failure,
                "after_failure": after_failure,
                "mismatch": mismatch,
            }, out)
    """
)


def _torchrun(*launch_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch_args]


def _check_report(report_path: Path, world_size: int) -> None:
    report = json.loads(report_path.read_text())
    expected_sum = float(sum(rank + 1 for rank in range(world_size)))
    assert report["world_size"] == world_size
    assert report["summed"] == [[rank, expected_sum] for rank in range(world_size)]
    assert report["after_failure"] == report["summed"]
    torch.manual_seed(99)
    local_draw = torch.rand(4).tolist()
    assert report["draws"] == [local_draw] * world_size
    assert report["failure"].startswith(f"rank {world_size - 1} raised ValueError: last rank fails")
    assert "rank 0 returned normally" in report["failure"]
    assert report["mismatch"].startswith(f"HarnessError: under torchrun the ranks are the launcher's (WORLD_SIZE={world_size})")


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]


def _run(commands: list[list[str]], tmp_path: Path) -> None:
    """Run the launchers side by side; their output goes to files so it survives a timeout."""
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    logs = [tmp_path / f"launcher{index}.log" for index in range(len(commands))]
    processes = []
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as out:
                processes.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                tails = "\n".join(f"--- launcher {index} ---\n{_tail(log)}" for index, log in enumerate(logs))
                pytest.fail(f"torchrun launch did not finish within {LAUNCH_TIMEOUT_S} s\n{tails}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for index, (process, log) in enumerate(zip(processes, logs)):
        assert process.returncode == 0, f"launcher {index} exited {process.returncode}\n{_tail(log)}"


@pytest.mark.slow
def test_torchrun_two_processes_on_one_node(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    report = tmp_path / "report.json"
    _run([_torchrun("--standalone", "--nproc-per-node", "2", str(script), str(report))], tmp_path)
    _check_report(report, 2)


@pytest.mark.slow
def test_torchrun_two_nodes_on_localhost(tmp_path):
    from torch.distributed import TCPStore

    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    report = tmp_path / "report.json"
    # The rendezvous store is held here on a port the kernel chose, so no port is ever probed
    # and released; both launchers join it as clients, as two hosts would join a head node.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    common = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", f"paritykit-{os.getpid()}",
        "--rdzv-conf", "is_host=false",
    ]
    commands = [_torchrun(*common, "--node-rank", str(node), str(script), str(report)) for node in (0, 1)]
    try:
        _run(commands, tmp_path)
    finally:
        del store
    _check_report(report, 2)


def test_get_pool_outside_torchrun_is_a_rank_pool(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_by_torchrun()
    with get_pool(1, device="cpu") as pool:
        assert isinstance(pool, RankPool)
        assert pool.world_size == 1 and pool.backend == "gloo"
        pool.close()


def test_launcher_group_outside_torchrun_names_the_missing_variables(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(HarnessError, match=r"missing environment variables \['WORLD_SIZE', 'LOCAL_RANK'\]"):
        LauncherGroup()
