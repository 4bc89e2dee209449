"""No rank process outlives its pool: after close, at interpreter exit, when the owner is killed, after Ctrl-C in pytest.

Each scenario runs in a child process tagged through an environment variable that every rank
inherits; afterwards no process on the machine may still carry the tag.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from paritykit.dist.rendezvous import PoolDirectory

TAG_VARIABLE = "PARITYKIT_TEST_TAG"
GONE_WITHIN_S = 20.0
STARTUP_LIMIT_S = 120.0

POOL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from paritykit.dist import RankPool

    if __name__ == "__main__":
        pool = RankPool(2, preload=("torch",))
        pool.wait_ready()
        print(" ".join(str(pid) for pid in pool.pids()), flush=True)
        if sys.argv[1] == "wait":
            time.sleep(3600)
        # "exit": leave without close(); the atexit handler must stop the ranks.
    """
)

INTERRUPTED_TEST = textwrap.dedent(
    """
    import time
    from pathlib import Path
    from paritykit.dist import RankPool

    def sleep_long():
        time.sleep(3600)

    def test_interrupted_mid_call():
        pool = RankPool(2, preload=("torch",))
        pool.wait_ready()
        Path("pids.txt").write_text(" ".join(str(pid) for pid in pool.pids()))
        pool.run(sleep_long)
    """
)


def processes_with_tag(tag: str) -> list[int]:
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def wait_until_gone(tag: str) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        remaining = processes_with_tag(tag)
        if not remaining:
            return []
        time.sleep(0.1)
    return processes_with_tag(tag)


def _open_pool_files(pid: int) -> list[Path]:
    """The pool files a rank holds open (its stack file lives in the pool's directory)."""
    paths = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.parent.name.startswith("paritykit-pool-"):
            paths.append(target)
    return paths


def tagged_environment(tag: str) -> dict[str, str]:
    env = dict(os.environ, **{TAG_VARIABLE: tag})
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_pool_owner(tmp_path: Path, mode: str, tag: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "owner.py"
    script.write_text(POOL_SCRIPT)
    owner = subprocess.Popen(
        [sys.executable, str(script), mode], env=tagged_environment(tag), stdout=subprocess.PIPE, text=True
    )
    line = owner.stdout.readline()
    assert line, f"the pool owner exited with code {owner.wait()} before its ranks started"
    return owner, [int(pid) for pid in line.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists processes through /proc (Linux only)")
class TestNoRankOutlivesItsPool:
    @pytest.mark.slow
    def test_interpreter_exit_without_close_stops_the_ranks(self, tmp_path):
        tag = uuid.uuid4().hex
        owner, rank_pids = start_pool_owner(tmp_path, "exit", tag)
        assert len(rank_pids) == 2
        assert owner.wait(timeout=STARTUP_LIMIT_S) == 0
        assert wait_until_gone(tag) == []

    def test_killed_owner_takes_its_ranks_with_it(self, tmp_path):
        tag = uuid.uuid4().hex
        owner, rank_pids = start_pool_owner(tmp_path, "wait", tag)
        assert set(rank_pids) <= set(processes_with_tag(tag))
        pool_directories = {path.parent for pid in rank_pids for path in _open_pool_files(pid)}
        owner.kill()
        owner.wait()
        assert wait_until_gone(tag) == []
        # A killed owner cannot remove its directory; the next pool on the machine does.
        assert len(pool_directories) == 1 and all(path.exists() for path in pool_directories)
        PoolDirectory().remove()
        assert not any(path.exists() for path in pool_directories)

    @pytest.mark.slow
    def test_ctrl_c_in_pytest_mid_call_leaves_no_rank(self, tmp_path):
        tag = uuid.uuid4().hex
        (tmp_path / "test_interrupted.py").write_text(INTERRUPTED_TEST)
        pytest_run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_interrupted.py"],
            cwd=tmp_path,
            env=tagged_environment(tag),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        pids_file = tmp_path / "pids.txt"
        deadline = time.monotonic() + STARTUP_LIMIT_S
        while not pids_file.exists() and pytest_run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_file.exists(), pytest_run.communicate()[0]
        time.sleep(0.5)  # let the call reach the ranks
        pytest_run.send_signal(signal.SIGINT)
        output = pytest_run.communicate(timeout=60)[0]
        assert pytest_run.returncode == 2, output  # pytest's "interrupted"
        assert "KeyboardInterrupt" in output
        assert wait_until_gone(tag) == []
