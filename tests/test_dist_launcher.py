"""get_pool under torchrun: the launcher's ranks behind RankPool's API on one and two "hosts", the gate at world
size 10 over two launchers, a rank that dies, and a pool standing for two hosts against a real launch of two."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from paritykit.checks.runner import NOT_UNDER_TORCHRUN
from paritykit.dist import LauncherGroup, RankPool, get_pool, launched_by_torchrun
from paritykit.errors import HarnessError
from host_topology import torchrec_topology
from test_dist_cleanup import TAG_VARIABLE, wait_until_gone

# A bound on a hung launch only (the launches here take seconds to minutes on 2 cores).
LAUNCH_TIMEOUT_S = 600

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


def _launch(commands: list[list[str]], tmp_path: Path, tag: str = "") -> tuple[list[int], list[Path], float]:
    """Run the launchers side by side; their output goes to files so it survives a timeout.

    Returns each launcher's exit code, its log and the seconds until the last one exited.
    """
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **({TAG_VARIABLE: tag} if tag else {}))
    logs = [tmp_path / f"launcher{index}.log" for index in range(len(commands))]
    processes = []
    started = time.monotonic()
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as out:
                processes.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))
        deadline = started + LAUNCH_TIMEOUT_S
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
    return [process.returncode for process in processes], logs, time.monotonic() - started


def _run(commands: list[list[str]], tmp_path: Path) -> None:
    codes, logs, _ = _launch(commands, tmp_path)
    for index, (code, log) in enumerate(zip(codes, logs)):
        assert code == 0, f"launcher {index} exited {code}\n{_tail(log)}"


def _free_local_port() -> int:
    # Static rendezvous: launcher 0 opens the store on this port itself, so it cannot be held here.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _two_static_launchers(ranks_per_launcher: int, *program: str) -> list[list[str]]:
    """Two torchrun launchers on localhost standing in for two hosts (static rendezvous on 127.0.0.1)."""
    common = [
        "--nnodes", "2", "--nproc-per-node", str(ranks_per_launcher),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_local_port()),
    ]
    return [_torchrun(*common, "--node-rank", str(node), *program) for node in (0, 1)]


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


@pytest.mark.slow
def test_gate_on_two_launchers_of_five_ranks_passes_td_kjt_at_world_size_10(tmp_path):
    program = ["-m", "paritykit", "gate", "--check", "td-kjt", "--device", "cpu", "--world-size", "10",
               "--examples", "2", "--report", "out"]
    _run(_two_static_launchers(5, *program), tmp_path)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    sharded = [case for case in report["cases"] if case["case_id"].startswith("sharded ") and " ws10 " in case["case_id"]]
    assert sharded, [case["case_id"] for case in report["cases"]]
    assert {case["status"] for case in sharded} == {"pass"}
    assert {case["metrics"]["world_size"] for case in sharded} == {10}
    # Cases that fail inside torchrec on some ranks only are not run under torchrun, and say why.
    known_broken = [case for case in report["cases"] if case["case_id"].startswith("known-broken ")]
    assert known_broken and {(case["status"], case["message"]) for case in known_broken} == {("skip", NOT_UNDER_TORCHRUN)}
    assert report["summary"]["exit_code"] == 0


@pytest.mark.slow
def test_gate_on_two_launchers_of_two_ranks_runs_the_cross_host_sharding_cases_on_the_launchs_hosts(tmp_path):
    program = ["-m", "paritykit", "gate", "--check", "sharding", "--device", "cpu", "--world-size", "4",
               "--examples", "3", "--report", "out"]
    _run(_two_static_launchers(2, *program), tmp_path)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    ran = [case for case in report["cases"] if not case["case_id"].startswith("known-broken ")]
    # The launch's hosts, not one host of 4: the pinned cross-host cases and draws placed by host.
    assert ran and all(" world_size=4 hosts=2x2 " in case["case_id"] for case in ran), [c["case_id"] for c in ran]
    assert {case["status"] for case in ran} == {"pass"}
    assert any("table_row_wise(1)" in case["case_id"] for case in ran) and any("grid_shard(1,0)" in case["case_id"] for case in ran)
    assert all("--hosts none " in case["replay"] for case in ran)
    assert report["summary"]["exit_code"] == 0


# Run by each of 4 ranks (2 launchers x 2): rank 3 dies (SIGKILL inside a call, or an exception
# outside any call); rank 0 writes what the survivors saw.
DYING_RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import torch
    import torch.distributed as dist
    from paritykit.dist import get_pool
    from paritykit.errors import RankFailure

    DOOMED = 3

    def all_ranks_sum():
        value = torch.tensor([1.0])
        dist.all_reduce(value)
        return value.item()

    def doomed_rank_is_killed_while_the_others_wait():
        if dist.get_rank() == DOOMED:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
        return "survived"

    pool = get_pool(int(os.environ["WORLD_SIZE"]), device="cpu")
    healthy = pool.run(all_ranks_sum)
    if sys.argv[2] == "raise" and pool.rank == DOOMED:
        raise ValueError("rank 3 fails outside any call")
    outcome = {"healthy": healthy}
    started = time.monotonic()
    try:
        pool.run(doomed_rank_is_killed_while_the_others_wait if sys.argv[2] == "signal" else all_ranks_sum)
    except RankFailure as exc:
        outcome.update(failure=str(exc), seconds=time.monotonic() - started)
    try:
        pool.run(all_ranks_sum)
    except RankFailure as exc:
        outcome["next_call"] = str(exc)
    if pool.is_reporting_rank:
        with open(sys.argv[1], "w") as out:
            json.dump(outcome, out)
    sys.exit(1 if "failure" in outcome else 0)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists processes through /proc (Linux only)")
@pytest.mark.parametrize("death", ["signal", "raise"])
def test_a_rank_that_dies_under_torchrun_is_reported_promptly_and_leaves_no_process(tmp_path, death):
    script = tmp_path / "dying.py"
    script.write_text(DYING_RANK_SCRIPT)
    report_path = tmp_path / "report.json"
    tag = uuid.uuid4().hex
    codes, logs, _ = _launch(_two_static_launchers(2, str(script), str(report_path), death), tmp_path, tag)
    survivors_log, doomed_host_log = (log.read_text(errors="replace") for log in logs)
    assert codes[0] != 0 and codes[1] != 0, (codes, survivors_log[-3000:], doomed_host_log[-3000:])
    report = json.loads(report_path.read_text())
    assert report["healthy"] == [4.0] * 4
    # Rank 0 names the ranks that are gone (3, and 2 when its launcher already stopped it), long
    # before the process group's 600 s timeout, and refuses the next call at once.
    lost = re.match(r"the launch lost ranks (\[[\d, ]+\]) during call #2 ", report["failure"])
    assert lost, report["failure"]
    assert 3 in json.loads(lost[1]) and set(json.loads(lost[1])) <= {2, 3}
    assert "rank 3 is gone (pid " in report["failure"]
    assert report["seconds"] < 300
    assert report["next_call"].startswith("not run: call #3 ")
    assert f"the launch lost ranks {lost[1]}" in report["next_call"]
    # The launcher on the dead rank's host reports it with its signal, or its traceback.
    assert re.search(r"rank\s*:\s*3 \(local_rank: 1\)", doomed_host_log), doomed_host_log[-3000:]
    if death == "signal":
        assert "Signal 9 (SIGKILL) received by PID" in doomed_host_log
    else:
        summary = doomed_host_log[doomed_host_log.index("Root Cause"):]
        assert "ValueError: rank 3 fails outside any call" in summary
    assert wait_until_gone(tag) == []


# Run by each of 4 ranks (2 launchers x 2): what torchrec sees of the hosts, and whether the launch's
# hosts are what paritykit's pools are asked for.
TOPOLOGY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, sys.argv[2])
    from host_topology import torchrec_topology
    from paritykit.dist import get_pool

    pool = get_pool(int(os.environ["WORLD_SIZE"]), device="cpu", ranks_per_host=2)
    seen = pool.run(torchrec_topology)
    try:
        get_pool(pool.world_size, ranks_per_host=pool.world_size)
        mismatch = None
    except Exception as exc:
        mismatch = f"{type(exc).__name__}: {exc}"
    if pool.is_reporting_rank:
        with open(sys.argv[1], "w") as out:
            json.dump({"seen": seen, "hosts": str(pool.hosts), "mismatch": mismatch}, out)
    """
)


@pytest.mark.slow
def test_a_pool_of_two_hosts_matches_torchrun_with_two_launchers_of_two_ranks(tmp_path, rank_pools):
    from test_dist_hosts import expected_topology

    script = tmp_path / "topology.py"
    script.write_text(TOPOLOGY_SCRIPT)
    report_path = tmp_path / "report.json"
    _run(_two_static_launchers(2, str(script), str(report_path), str(Path(__file__).parent)), tmp_path)
    report = json.loads(report_path.read_text())
    launched = report["seen"]
    assert report["hosts"] == "2x2"
    assert report["mismatch"].startswith("HarnessError: under torchrun the hosts are the launch's (2 hosts x 2 ranks")
    assert [seen.pop("launched_by_torchrun") for seen in launched] == [True] * 4
    emulated = rank_pools.get(4, ranks_per_host=2).run(torchrec_topology)
    assert [seen.pop("launched_by_torchrun") for seen in emulated] == [False] * 4
    # The same variables, torchrec helpers and process groups as the real launch, rank by rank.
    assert emulated == launched
    assert launched == [{k: v for k, v in seen.items() if k != "launched_by_torchrun"} for seen in expected_topology(2, 2)]
