"""Known torchrec issue tower-sharding-idle-host-desyncs-process-groups (listed for torchrec >=1.8,<1.10).

sharding an EmbeddingTowerCollection (or EmbeddingTower) where some host holds no tower creates a process
group on the tower hosts' ranks only: ShardingEnv(intra-host group) builds a device mesh (init_device_mesh
calls new_group), which torch requires every rank to enter. torch numbers process groups in creation order
on each rank, so the ranks fall out of step and the next process group created on every rank (DCP, another
sharding, the user's new_group) pairs up wrongly and hangs. The sharded towers themselves compute right.

What to do instead: place at least one tower on every host, or create the missed groups on the idle hosts'
ranks (a non-member dist.new_group call each) right after sharding.

The script spawns 2 ranks standing for 2 hosts of 1 rank (LOCAL_WORLD_SIZE=1, as torchrun sets it; gloo on
CPU, a file:// rendezvous in a temporary directory, 60 s timeouts). Each builds the same
EmbeddingTowerCollection (towers of an EBC of one table, 6 rows x 4, and a linear interaction 4 -> 2), plans
every tower's table table-row-wise on its host and shards it with EmbeddingTowerCollectionSharder (called
with no device: DistributedModelParallel cannot shard towers on CPU, tower-sharding-cpu-ddp-device-ids).
Then both ranks create one more process group of both ranks, as any later code would, and all-reduce a 1
over it with a 20 s timeout. The oracle is what torch promises for a group every rank creates: the
all-reduce gives 2 on both ranks; each rank's count of process groups created while sharding is printed.

    python this_script.py            one tower, on host 0 (host 1 holds none)
    python this_script.py --control  two towers, one on each host

    exit 0: the group created after sharding works on both ranks (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
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


WORLD_SIZE, SEED = 2, 9


class Interaction(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, pooled):
        return self.linear(pooled.values())


def collection(towers: int):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

    torch.manual_seed(SEED)
    return EmbeddingTowerCollection([EmbeddingTower(EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{t}", embedding_dim=4, num_embeddings=6, feature_names=[f"f{t}"])],
        device=torch.device("cpu")), Interaction()) for t in range(towers)], device=torch.device("cpu"))


def groups_created() -> int:
    from torch.distributed import distributed_c10d

    return distributed_c10d._world.group_count


def run_rank(rank: int, scratch: str, towers: int) -> None:
    result, failed = {"rank": rank}, False
    try:
        os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")  # 2 hosts of 1 rank, as torchrun tells torchrec
        start_process_group(rank, WORLD_SIZE, scratch)
        from torchrec.distributed.embedding_tower_sharding import EmbeddingTowerCollectionSharder
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_row_wise
        from torchrec.distributed.types import ShardingEnv

        model = collection(towers)
        sharder = EmbeddingTowerCollectionSharder()
        plan = construct_module_sharding_plan(model, {f"t{t}": table_row_wise(host_index=t) for t in range(towers)},
                                              world_size=WORLD_SIZE, local_size=1, device_type="cpu", sharder=sharder)
        before = groups_created()
        sharder.shard(model, plan, ShardingEnv.from_process_group(dist.group.WORLD), None)
        result["created"] = groups_created() - before
        try:
            group = dist.new_group(ranks=[0, 1], timeout=datetime.timedelta(seconds=20))
            one = torch.ones(1)
            dist.all_reduce(one, group=group)
            result["sum"] = one.item()
        except Exception as exc:  # noqa: BLE001 - the group's failure is the finding, reported with the counts
            result["group_error"] = f"{type(exc).__name__}: {first_lines(str(exc), 1)}"
            failed = True
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which tells torchrec's raise apart
        where = library_frame(exc)
        result.update(error=f"{type(exc).__name__}: {exc}", torchrec=bool(where), where=where)
        failed = True
    finish_rank(scratch, result, failed)


def main() -> int:
    control = control_requested("place a tower on each host")
    towers = 2 if control else 1
    results = run_ranks(run_rank, (towers,), WORLD_SIZE, deadline_s=120)
    where = "one tower, on host 0" if towers == 1 else "a tower on each host"
    # A rank whose next group failed exits at once, and its peer (possibly still waiting in that group) is ended.
    created = [result.get("created", "?") for result in results]
    for result in results:
        if "group_error" in result:
            return reproduced(f"{where}: sharding created {created} process groups on ranks 0-1 ('?': the rank was ended); "
                              f"the group both ranks created next fails on rank {result['rank']}: {result['group_error']}")
    for result in results:
        if "error" in result:
            if result.get("torchrec"):
                return reproduced(f"rank {result['rank']} raised {result['error']} (in {result['where']})")
            return cannot_run(f"rank {result['rank']}: {result['error']}")
    broken = [r for r in results if r.get("sum") != float(WORLD_SIZE)]
    if broken:
        return reproduced(f"{where}: sharding created {created} process groups on ranks 0-1; the all-reduce over the group "
                          f"both ranks created next gave {broken[0].get('sum')} on rank {broken[0]['rank']}, not 2")
    return ok(f"{where}: sharding created {created} process groups on ranks 0-1; the next group's all-reduce gives 2 on both")


if __name__ == "__main__":
    run_script(main)
