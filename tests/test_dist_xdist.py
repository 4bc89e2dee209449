"""Four pools at once under `pytest -n 4`: no rendezvous collision, right results, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import pytest

from test_dist_cleanup import tagged_environment, wait_until_gone

CALLS_PER_POOL = 20

CONCURRENT_TESTS = textwrap.dedent(
    f"""
    import json, os, time
    import pytest
    import torch
    import torch.distributed as dist
    from paritykit.dist import RankPool

    def rank_sum(offset):
        value = torch.tensor([dist.get_rank() + offset])
        dist.all_reduce(value)
        return int(value.item())

    @pytest.mark.parametrize("index", range(4))
    def test_pool(index):
        with RankPool(2, preload=("torch",)) as pool:
            pool.wait_ready()
            started = time.time()
            results = [pool.run(rank_sum, offset) for offset in range({CALLS_PER_POOL})]
            # Hold the pool until every worker's pool is up, so all four are alive at once.
            deadline = time.time() + 120
            with open(f"up-{{index}}", "w"):
                pass
            while len([n for n in os.listdir(".") if n.startswith("up-")]) < 4 and time.time() < deadline:
                time.sleep(0.05)
            with open(f"pool-{{index}}.json", "w") as out:
                json.dump({{"worker": os.environ["PYTEST_XDIST_WORKER"], "pids": pool.pids(),
                           "started": started, "ended": time.time(), "results": results}}, out)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists processes through /proc (Linux only)")
def test_four_pools_under_pytest_n_4(tmp_path):
    tag = uuid.uuid4().hex
    (tmp_path / "test_concurrent.py").write_text(CONCURRENT_TESTS)
    run = subprocess.run(
        # An explicit --dist keeps four workers (a bare -n is capped at the cores by the plugin).
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4", "--dist", "load", "test_concurrent.py"],
        cwd=tmp_path, env=tagged_environment(tag), capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout
    pools = [json.loads((tmp_path / f"pool-{index}.json").read_text()) for index in range(4)]
    assert len({pool["worker"] for pool in pools}) == 4
    assert len({pid for pool in pools for pid in pool["pids"]}) == 8
    for pool in pools:
        assert pool["results"] == [[2 * offset + 1] * 2 for offset in range(CALLS_PER_POOL)]
    # All four were up at the same moment.
    assert max(pool["started"] for pool in pools) < min(pool["ended"] for pool in pools)
    assert wait_until_gone(tag) == []
