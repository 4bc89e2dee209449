"""Ranks of a RankPool know they share one host: torchrec finds LOCAL_WORLD_SIZE and stays quiet.

torchrec's get_local_size() logs "Could not determine LOCAL_WORLD_SIZE" through the root logger
whenever the variable is missing, once per sharded module and more; ranks of a pool now get
LOCAL_WORLD_SIZE and LOCAL_RANK as torchrun would set them. The pool runs in a child process so
that the ranks' stderr (inherited) can be read whole.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

WARNING = "Could not determine LOCAL_WORLD_SIZE"
CONTROL_MARK = "--- control: LOCAL_WORLD_SIZE removed on the ranks ---"

SCRIPT = textwrap.dedent(
    f"""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from paritykit.dist import RankPool

    def local_topology_and_sharded_forward():
        from torchrec.distributed.comm import get_local_rank, get_local_size
        from paritykit.harness.sharded import shard_module
        from paritykit.harness.tables import TableSpec, build_ebc, kjt_from_rows

        tables = (TableSpec("t0", 8, 4, ("f0",)), TableSpec("t1", 8, 4, ("f1",)))
        ebc = shard_module(build_ebc(tables, seed=0), {{"t0": ("table_wise", 0), "t1": ("row_wise",)}})
        rows = {{"f0": [[1, 2], [3]], "f1": [[4], []]}}
        pooled = ebc(kjt_from_rows(("f0", "f1"), rows)).wait()
        return get_local_size(), get_local_rank(), os.environ["LOCAL_WORLD_SIZE"], list(pooled.values().shape)

    def local_size_without_the_variable():
        from torchrec.distributed.comm import get_local_size

        del os.environ["LOCAL_WORLD_SIZE"]
        try:
            return get_local_size()
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = str(dist.get_world_size())

    if __name__ == "__main__":
        with RankPool(2) as pool:
            print(json.dumps(pool.run(local_topology_and_sharded_forward)), flush=True)
            print({CONTROL_MARK!r}, file=sys.stderr, flush=True)
            print(json.dumps(pool.run(local_size_without_the_variable)), flush=True)
    """
)


def test_pool_ranks_report_one_host_to_torchrec_and_print_no_local_world_size_warning(tmp_path):
    script = tmp_path / "quiet.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    sharded, control = run.stdout.strip().splitlines()
    assert sharded == '[[2, 0, "2", [2, 8]], [2, 1, "2", [2, 8]]]'
    before_control, after_control = run.stderr.split(CONTROL_MARK)
    assert WARNING not in before_control
    # The negative control: the same torchrec call without the variable does print the line (once
    # per rank), so its absence above is the fix, not a silenced logger.
    assert after_control.count(WARNING) == 2
    assert control == "[2, 2]"
