"""Examples per second of a 2-rank sharding check: through a RankPool vs fresh processes per example.

The example: build an EmbeddingBagCollection, shard it (one table table-wise, one row-wise) from an
explicit plan, copy the unsharded module's weights into the shards, run a forward on each rank's
batch and compare with the unsharded module. The baseline spawns two fresh processes per example
and initialises, uses and destroys a process group in them, the way torchrec's
MultiProcessTestBase runs each test. Also printed: the pool's start-up time and its own cost per
call (a function that does nothing). Everything is measured in this one run.

    python bench/bench_rank_pool.py [--pool-examples 40] [--spawn-examples 3] [--empty-calls 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def sharded_ebc_matches_unsharded(seed: int) -> float:
    """One example on this rank; returns the max abs difference (0.0 when sharding is exact)."""
    import logging
    import warnings

    # torchrec logs a warning per table and sharding call; it would drown the figures.
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=64, feature_names=[f"f{i}"])
        for i in range(2)
    ]
    reference = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    plan = construct_module_sharding_plan(
        EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        per_param_sharding={"t0": table_wise(rank=0, compute_kernel="dense"), "t1": row_wise(compute_kernel="dense")},
        local_size=WORLD_SIZE,
        world_size=WORLD_SIZE,
        device_type="cpu",
    )
    sharded = shard(
        EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        plan,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
    )
    weights = reference.state_dict()
    with torch.no_grad():
        for name, tensor in sharded.state_dict().items():
            if isinstance(tensor, ShardedTensor):
                for local in tensor.local_shards():
                    (row, col), (rows, cols) = local.metadata.shard_offsets, local.metadata.shard_sizes
                    local.tensor.copy_(weights[name][row : row + rows, col : col + cols])
            else:
                tensor.copy_(weights[name])
    # A different batch on each rank, drawn from a rank-specific generator.
    generator = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    lengths = torch.randint(0, 4, (2 * 4,), generator=generator)
    values = torch.randint(0, 64, (int(lengths.sum()),), generator=generator)
    batch = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=values, lengths=lengths)
    expected = reference(batch).values()
    actual = sharded(batch)
    actual = actual.wait() if hasattr(actual, "wait") else actual
    return (actual.values() - expected).abs().max().item()


def do_nothing() -> None:
    return None


def _spawned_rank(rank: int, init_file: str, seed: int, results: "mp.Queue") -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        results.put((rank, sharded_ebc_matches_unsharded(seed)))
    finally:
        dist.destroy_process_group()


def spawn_per_example(seed: int) -> list[float]:
    """Two fresh processes for one example, as MultiProcessTestBase does per test."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="paritykit-bench-") as directory:
        processes = [
            context.Process(target=_spawned_rank, args=(rank, os.path.join(directory, "store"), seed, results))
            for rank in range(WORLD_SIZE)
        ]
        for process in processes:
            process.start()
        collected = dict(results.get(timeout=300) for _ in processes)
        for process in processes:
            process.join()
            if process.exitcode != 0:
                raise RuntimeError(f"spawned rank exited with {process.exitcode}")
    return [collected[rank] for rank in range(WORLD_SIZE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-examples", type=int, default=40)
    parser.add_argument("--spawn-examples", type=int, default=3)
    parser.add_argument("--empty-calls", type=int, default=300)
    options = parser.parse_args()

    from paritykit.dist import RankPool

    started = time.perf_counter()
    with RankPool(WORLD_SIZE, device="cpu") as pool:
        pool.wait_ready()
        startup_s = time.perf_counter() - started

        pool.run(do_nothing)
        empty = []
        for _ in range(options.empty_calls):
            t0 = time.perf_counter()
            pool.run(do_nothing)
            empty.append(time.perf_counter() - t0)

        pool.run_seeded(0, sharded_ebc_matches_unsharded, 0)  # first use of torchrec's sharders
        t0 = time.perf_counter()
        for seed in range(options.pool_examples):
            diffs = pool.run_seeded(seed, sharded_ebc_matches_unsharded, seed)
            assert diffs == [0.0] * WORLD_SIZE, f"seed {seed}: sharded output differs by {diffs}"
        pool_per_example = (time.perf_counter() - t0) / options.pool_examples

    t0 = time.perf_counter()
    for seed in range(options.spawn_examples):
        diffs = spawn_per_example(seed)
        assert diffs == [0.0] * WORLD_SIZE, f"seed {seed}: sharded output differs by {diffs}"
    spawn_per_example_s = (time.perf_counter() - t0) / options.spawn_examples

    print(f"cpu cores: {os.cpu_count()}, world size {WORLD_SIZE}, backend gloo")
    print(f"pool start-up (spawn, import torch+torchrec, process group): {startup_s:.2f} s")
    print(
        f"pool cost per call (empty function, {options.empty_calls} calls): "
        f"median {statistics.median(empty) * 1e3:.2f} ms, p90 {sorted(empty)[int(0.9 * len(empty))] * 1e3:.2f} ms"
    )
    print(f"sharded-EBC example through the pool: {pool_per_example * 1e3:.1f} ms ({options.pool_examples} examples)")
    print(f"sharded-EBC example, fresh processes per example: {spawn_per_example_s:.2f} s ({options.spawn_examples} examples)")
    print(f"examples per second, pool / spawn-per-example: {spawn_per_example_s / pool_per_example:.0f}x (goal >= 60x)")


if __name__ == "__main__":
    main()
