"""Wall and CPU time of a suite that uses rank pools: serial vs `pytest -n 4` as the plugin runs it
(pool tests grouped on one worker, at most one worker per core) vs `pytest -n 4 --dist load` (an
explicit --dist: four workers, each starting its own pools, which is what -n 4 did before).

The suite: this repository's tests/test_dist_pool.py (a module-scoped pool of its own) and a
downstream-like file written here: a tutorial-style EmbeddingBagCollection sharded table-wise and
row-wise on the `rank_pool` fixture, checked against the unsharded module in a @given property and
in parametrized tests, a world-size-1 test, and plain tests without ranks. Each configuration runs
in a fresh pytest process in the same run; ratios are to the serial run.

    python bench/bench_xdist_pools.py [--repeats 1] [--workers 4]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent

DOWNSTREAM_TESTS = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist
    from hypothesis import given, strategies as st

    import paritykit

    def sharded_matches_unsharded(ids):
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.distributed.shard import shard
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
        from torchrec.distributed.types import ShardingEnv

        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=32, feature_names=[f"f{i}"]) for i in range(2)]
        reference = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        plan = construct_module_sharding_plan(
            EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            per_param_sharding={"t0": table_wise(rank=0), "t1": row_wise()},
            world_size=dist.get_world_size(), device_type="cpu",
        )
        sharded = shard(EmbeddingBagCollection(tables=tables, device=torch.device("meta")), plan,
                        env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"))
        full = reference.state_dict()
        for name, value in sharded.state_dict().items():
            for local in value.local_shards():
                (rows, cols), (height, width) = local.metadata.shard_offsets, local.metadata.shard_sizes
                local.tensor.copy_(full[name][rows:rows + height, cols:cols + width])
        batch = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor(ids), torch.tensor([len(ids), 0, 0, 0]))
        paritykit.assert_close(sharded(batch).wait(), reference(batch))
        return True

    def rank_count():
        value = torch.tensor([1])
        dist.all_reduce(value)
        return int(value.item())

    @given(st.lists(st.integers(0, 31), min_size=1, max_size=6))
    def test_sharded_ebc_matches_unsharded_for_any_ids(rank_pool, ids):
        assert rank_pool.run(sharded_matches_unsharded, ids) == [True, True]

    @pytest.mark.parametrize("ids", [[0], [1, 2], [31, 30, 29]])
    def test_sharded_ebc_matches_unsharded(rank_pool, ids):
        assert rank_pool.run(sharded_matches_unsharded, ids) == [True, True]

    @pytest.mark.world_size(1)
    def test_one_rank(rank_pool):
        assert rank_pool.run(rank_count) == [1]

    @pytest.mark.parametrize("index", range(12))
    def test_without_ranks(index):
        assert torch.arange(index).sum().item() == index * (index - 1) // 2
    """
)


def build_suite(directory: Path) -> None:
    (directory / "pytest.ini").write_text("[pytest]\n")
    shutil.copy(REPOSITORY / "tests" / "test_dist_pool.py", directory / "test_dist_pool.py")
    (directory / "test_downstream.py").write_text(DOWNSTREAM_TESTS)


def timed_run(directory: Path, extra: list[str]) -> tuple[float, float]:
    """Wall seconds, and CPU seconds of pytest and every process under it (workers, ranks): the CPU
    figure moves far less than the wall time when other work shares the machine."""
    environment = dict(os.environ, PARITYKIT_PROFILE="dev", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    run = subprocess.run(command, cwd=directory, env=environment, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(extra) or 'serial'} failed:\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}")
    return elapsed, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    n = str(args.workers)
    configurations = {"serial": [], f"-n {n} (plugin)": ["-n", n], f"-n {n} --dist load": ["-n", n, "--dist", "load"]}
    with tempfile.TemporaryDirectory(prefix="paritykit-bench-xdist-") as temporary:
        directory = Path(temporary)
        build_suite(directory)
        runs = {name: [] for name in configurations}
        for _ in range(args.repeats):  # interleaved, so that a burst of other load hits every configuration
            for name, extra in configurations.items():
                runs[name].append(timed_run(directory, extra))
    serial_wall = min(wall for wall, _ in runs["serial"])
    serial_cpu = min(cpu for _, cpu in runs["serial"])
    print(f"{'configuration':<26} {'best wall s':>11} {'vs serial':>9} {'best CPU s':>10} {'vs serial':>9}  every run (wall/CPU s)")
    for name, values in runs.items():
        wall, cpu = min(w for w, _ in values), min(c for _, c in values)
        every = ", ".join(f"{w:.0f}/{c:.0f}" for w, c in values)
        print(f"{name:<26} {wall:11.1f} {wall / serial_wall:8.2f}x {cpu:10.1f} {cpu / serial_cpu:8.2f}x  {every}")
    print(f"cores: {os.cpu_count()}; load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
