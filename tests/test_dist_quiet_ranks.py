"""Ranks of a RankPool know they share one host: torchrec finds LOCAL_WORLD_SIZE and stays quiet.

torchrec's get_local_size() logs "Could not determine LOCAL_WORLD_SIZE" through the root logger
whenever the variable is missing: shard() with a plan of torchrec's generators calls it once per
table on every rank, DistributedModelParallel and the planner once more each. Ranks of a pool now
get LOCAL_WORLD_SIZE and LOCAL_RANK as torchrun would set them. The pool runs in a child process so
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

    def planned_shard_and_forward():
        # A plan of torchrec's own per-table generators, as downstream suites give it: shard()
        # calls each generator with get_local_size(), once per table on every rank.
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.distributed.shard import shard
        from torchrec.distributed.sharding_plan import row_wise, table_wise
        from torchrec.distributed.types import ShardingEnv

        tables = [EmbeddingBagConfig(name=f"t{{i}}", embedding_dim=4, num_embeddings=8, feature_names=[f"f{{i}}"]) for i in range(2)]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        plan = {{"t0": table_wise(rank=0), "t1": row_wise()}}
        sharded = shard(ebc, plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"))
        batch = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([1, 2, 3, 4]), torch.tensor([2, 1, 1, 0]))
        return list(sharded(batch).wait().values().shape)

    def topology_seen_by_torchrec():
        from torchrec.distributed.comm import get_local_rank, get_local_size

        return get_local_size(), get_local_rank(), os.environ["LOCAL_WORLD_SIZE"], planned_shard_and_forward()

    def planned_shard_without_the_variable():
        del os.environ["LOCAL_WORLD_SIZE"]
        try:
            return planned_shard_and_forward()
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = str(dist.get_world_size())

    if __name__ == "__main__":
        with RankPool(2) as pool:
            print(json.dumps(pool.run(topology_seen_by_torchrec)), flush=True)
            print({CONTROL_MARK!r}, file=sys.stderr, flush=True)
            print(json.dumps(pool.run(planned_shard_without_the_variable)), flush=True)
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
    # The negative control: the same torchrec path without the variable does print the line on
    # every rank, so its absence above is the fix, not a silenced logger.
    assert after_control.count(WARNING) == 2 * 2  # two tables, two ranks
    assert control == "[[2, 8], [2, 8]]"
