"""Known torchrec issue tower-collection-output-in-host-order (listed for torchrec >=1.8,<1.10).

a sharded EmbeddingTowerCollection returns its towers' output columns grouped by the host each tower is
placed on (the output all-to-all over the cross-host group concatenates hosts in order), while the
unsharded collection returns them in its towers' order: when the towers are not placed on hosts in the
collection's order (tower 0 on host 1, tower 1 on host 0) the outputs are silently permuted, and whatever
reads those columns trains on the wrong features.

What to do instead: place the towers on hosts in the order the collection lists them (host indexes that
never decrease along module.towers), or reorder the towers to match their hosts.

The script spawns 2 ranks standing for 2 hosts of 1 rank (LOCAL_WORLD_SIZE=1, as torchrun sets it; gloo on
CPU, a file:// rendezvous in a temporary directory, 60 s timeouts). Each builds the same
EmbeddingTowerCollection of two towers (tower 0: an EBC of table t0, 6 rows x 4, reading f0, then a linear
interaction 4 -> 3; tower 1: table t1, 5 rows x 4, reading f1, then 4 -> 2; every weight from a seeded
generator), places tower 0's table table-row-wise on host 1 and tower 1's on host 0, shards it with
EmbeddingTowerCollectionSharder (called with no device: DistributedModelParallel cannot shard towers on
CPU, tower-sharding-cpu-ddp-device-ids), loads the unsharded tables into the shards, and computes its
outputs on its own batch. The oracle is the unsharded collection on that rank's batch: its outputs,
columns 0-2 tower 0's and 3-4 tower 1's, within 64 units of float32 roundoff x (|unsharded| +
max|unsharded|).

    python this_script.py            tower 0 on host 1, tower 1 on host 0
    python this_script.py --control  tower 0 on host 0, tower 1 on host 1

    exit 0: every rank's outputs are the unsharded collection's (prints OK)
    exit 1: they are not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

# --- paritykit repro prelude (generated from paritykit/gate/repro_prelude.py; do not edit) ---
# Plumbing shared by paritykit's hand-written reproductions; the script's own story follows the prelude.
import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXIT_OK, EXIT_REPRODUCED, EXIT_CANNOT_RUN = 0, 1, 2
TORCHREC = ("torchrec", "fbgemm_gpu")  # a raise inside these is torchrec's; elsewhere the script failed
COLLECTIVE_TIMEOUT_S = 60  # a rank waiting on a collective gives up after this
DEADLINE_S = 240  # the parent ends every rank after this


def ok(message: str) -> int:
    print(f"OK: {message}")
    return EXIT_OK


def reproduced(message: str) -> int:
    print(f"REPRODUCED: {message}")
    return EXIT_REPRODUCED


def cannot_run(message: str) -> int:
    print(f"CANNOT RUN: {message}")
    return EXIT_CANNOT_RUN


def run_script(main) -> None:
    """Exits with ``main()``'s code; an exception that escapes it is this script's failure (exit 2), never
    Python's exit 1, which would read as a reproduction."""
    try:
        code = main()
    except Exception:  # noqa: BLE001 - whatever the script itself failed on
        code = cannot_run(f"the script itself failed:\n{traceback.format_exc()}")
    sys.exit(code)


def control_requested(help_text: str) -> bool:
    """Whether the script runs its --control: the nearest configuration torchrec computes right."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--control", action="store_true", help=help_text)
    return parser.parse_args().control


def library_frame(exc: BaseException, places: tuple = TORCHREC) -> str:
    """The innermost frame in one of ``places`` (folders such as "torchrec" or "torch/distributed") of the
    exception's traceback, as "file:line (function: code)"; "" when the exception did not come from there."""
    marks = [os.sep + os.path.join(*place.split("/")) + os.sep for place in places]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if any(mark in f.filename for mark in marks)]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name}: {frames[-1].line})" if frames else ""


def first_lines(text: str, count: int = 3) -> str:
    """The reason on an exception's first lines (DCP's exception repeats every rank's traceback)."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    return " | ".join(lines[:count])


def verdict_of_raise(exc: BaseException, what: str, places: tuple = TORCHREC) -> int:
    """A raise out of ``what``: torchrec's is a reproduction (its type, message and frame); else CANNOT RUN."""
    where = library_frame(exc, places)
    if not where:
        return cannot_run(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    return reproduced(f"{what} raised {type(exc).__name__}: {exc} (in {where})".replace("\n", " "))


def roundoff_bound(expected: torch.Tensor, units: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``units`` units of roundoff of ``dtype`` x (|expected| + max|expected|): a few roundings per operation
    summed in another order stay inside; a wrong row, state or step is off by O(1)."""
    scale = expected.abs().max() if expected.numel() else 0.0
    return units * torch.finfo(dtype).eps / 2 * (expected.abs() + scale)


def first_difference(actual: torch.Tensor, expected: torch.Tensor, bound, origin: tuple = (), oracle: str = "oracle") -> str:
    """"" when ``actual`` is within ``bound`` of ``expected`` everywhere; else the shapes, or how many elements
    differ and the first (its index in the full tensor: ``origin`` added) with both values. NaN differs."""
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)} vs {oracle} {tuple(expected.shape)}"
    bad = ~((actual - expected).abs() <= bound)
    if not bool(bad.any()):
        return ""
    index = tuple(int(i) for i in bad.nonzero()[0])
    at = [o + i for o, i in zip(origin, index)] if origin else list(index)
    return (f"{int(bad.sum())} of {bad.numel()} elements differ, first at {at}: "
            f"{actual[index].item():.6g} vs {oracle} {expected[index].item():.6g}")


def start_process_group(rank: int, world_size: int, scratch: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """gloo on the CPU, a file:// rendezvous in ``scratch``, collectives that give up after ``timeout_s``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


class OneRank:
    """A process group of this process alone (gloo, world size 1) for a with-block: DMP needs one."""

    def __enter__(self) -> "OneRank":
        self.scratch = tempfile.TemporaryDirectory(prefix="torchrec-repro-")
        start_process_group(0, 1, self.scratch.name)
        return self

    def __exit__(self, *raised) -> bool:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.scratch.cleanup()
        return False  # an exception goes on to the script's verdict


def finish_rank(scratch: str, result: dict, failed: bool) -> None:
    """Hands this rank's result (a JSON dict with its "rank") to the parent. A failed rank exits at once (another
    may wait in a collective: torch.multiprocessing ends it); the others leave the process group together."""
    with open(os.path.join(scratch, f"rank{result['rank']}.json"), "w") as file:
        json.dump(result, file)
    if failed:
        sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(run_rank, args: tuple, world_size: int, deadline_s: float = DEADLINE_S) -> list:
    """Runs ``run_rank(rank, scratch, *args)`` in ``world_size`` processes (torch.multiprocessing "spawn"),
    ends them all after ``deadline_s``, and returns each rank's result. A rank that crashed, hung or wrote no
    result gets {"rank": rank, "error": why}: the script could not run, never a reproduction."""
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        context = mp.start_processes(run_rank, args=(scratch, *args), nprocs=world_size, join=False, start_method="spawn")
        deadline, ended = datetime.datetime.now() + datetime.timedelta(seconds=deadline_s), ""
        try:
            while not context.join(timeout=1):
                if datetime.datetime.now() > deadline:
                    ended = f"it did not finish within {deadline_s} s"
                    break
        except Exception as exc:  # a rank exited early (it wrote why); torch.multiprocessing ended the others
            ended = f"a rank exited early ({type(exc).__name__}: {first_lines(str(exc), 1)})"
        results = [read_result(scratch, rank, ended) for rank in range(world_size)]
        for result, process in zip(results, context.processes):
            if process.is_alive():  # hung past the deadline, whatever it wrote
                process.kill()
                process.join()
                result["error"] = ended
        return results


def read_result(scratch: str, rank: int, ended: str) -> dict:
    try:
        with open(os.path.join(scratch, f"rank{rank}.json")) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {"rank": rank, "error": f"it wrote no result ({ended or 'it ended without one'})"}
# --- end prelude ---


WORLD_SIZE, SEED = 2, 5
TOWERS = (("t0", "f0", 6, 3), ("t1", "f1", 5, 2))  # table, feature, rows, the interaction's output width
BATCHES = [  # per rank, per feature: the ids of each sample
    {"f0": [[1, 4], [], [5]], "f1": [[0], [2, 3], [4]]},
    {"f0": [[0], [2, 2, 3], []], "f1": [[], [1], [3, 0]]},
]


class Interaction(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(4, width)

    def forward(self, pooled):
        return self.linear(pooled.values())


def collection():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

    generator = torch.Generator().manual_seed(SEED)
    towers = []
    for table, feature, rows, width in TOWERS:
        ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=table, embedding_dim=4, num_embeddings=rows,
                                                                feature_names=[feature])], device=torch.device("cpu"))
        interaction = Interaction(width)
        with torch.no_grad():
            for param in list(ebc.parameters()) + list(interaction.parameters()):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 - 1)
        towers.append(EmbeddingTower(ebc, interaction))
    return EmbeddingTowerCollection(towers, device=torch.device("cpu"))


def features(rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = BATCHES[rank]
    return KeyedJaggedTensor(keys=list(batch), values=torch.tensor([i for ids in batch.values() for sample in ids for i in sample]),
                             lengths=torch.tensor([len(sample) for ids in batch.values() for sample in ids]))


def load_tables(sharded, full: dict) -> None:
    """Each local shard gets its rows of the unsharded table."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for key, value in sharded.state_dict().items():
        table = key.split(".")[-2]
        if isinstance(value, ShardedTensor) and table in full:
            for shard in value.local_shards():
                (row, column), (rows, columns) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.detach().copy_(full[table][row:row + rows, column:column + columns])


def run_rank(rank: int, scratch: str, hosts: tuple) -> None:
    result, failed = {"rank": rank}, False
    try:
        os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")  # 2 hosts of 1 rank, as torchrun tells torchrec
        start_process_group(rank, WORLD_SIZE, scratch)
        from torchrec.distributed.embedding_tower_sharding import EmbeddingTowerCollectionSharder
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_row_wise
        from torchrec.distributed.types import ShardingEnv

        model = collection()
        full = {name: bag.weight.detach().clone() for tower in model.towers for name, bag in tower.embedding.embedding_bags.items()}
        sharder = EmbeddingTowerCollectionSharder()
        plan = construct_module_sharding_plan(model, {table: table_row_wise(host_index=host) for (table, *_), host in zip(TOWERS, hosts)},
                                              world_size=WORLD_SIZE, local_size=1, device_type="cpu", sharder=sharder)
        sharded = sharder.shard(model, plan, ShardingEnv.from_process_group(dist.group.WORLD), None)
        load_tables(sharded, full)
        output = sharded(features(rank))
        result["outputs"] = (output.wait() if hasattr(output, "wait") else output).detach().tolist()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which tells torchrec's raise apart
        where = library_frame(exc)
        result.update(error=f"{type(exc).__name__}: {exc}", torchrec=bool(where), where=where)
        failed = True
    finish_rank(scratch, result, failed)


def main() -> int:
    control = control_requested("place tower 0 on host 0 and tower 1 on host 1, the collection's order")
    hosts = (0, 1) if control else (1, 0)
    results = run_ranks(run_rank, (hosts,), WORLD_SIZE)
    for result in results:
        if "error" in result:
            if result.get("torchrec"):
                return reproduced(f"rank {result['rank']} raised {result['error']} (in {result['where']})")
            return cannot_run(f"rank {result['rank']}: {result['error']}")
    unsharded = collection()
    placed = f"tower 0 on host {hosts[0]}, tower 1 on host {hosts[1]}"
    for result in results:
        expected = unsharded(features(result["rank"])).detach()
        actual = torch.tensor(result["outputs"])
        found = first_difference(actual, expected, roundoff_bound(expected), oracle="unsharded")
        if found:
            swapped = torch.cat([expected[:, 3:], expected[:, :3]], dim=1)
            order = (" (they are the unsharded outputs with tower 1's columns first: host order)"
                     if not first_difference(actual, swapped, roundoff_bound(swapped)) else "")
            return reproduced(f"{placed}: rank {result['rank']}'s outputs are not the unsharded collection's: {found}{order}")
    return ok(f"{placed}: every rank's outputs are the unsharded collection's, towers' columns in its order")


if __name__ == "__main__":
    run_script(main)
