"""Known torchrec issue ebc-unweighted-uses-kjt-weights (listed for torchrec >=1.8,<1.10).

an EmbeddingBagCollection built unweighted (is_weighted=False) ignores the per-id weights of the
KeyedJaggedTensor it is fed; sharded (any placement) it multiplies the ids by them.

What to do instead: feed an unweighted EmbeddingBagCollection KeyedJaggedTensors without weights
(or build it with is_weighted=True if the weights are meant).

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU, a file:// rendezvous in a temporary
directory, 60 s timeouts). Each builds an unweighted EmbeddingBagCollection of three SUM tables (t0,
t1, t2 reading f0, f1, f2; weights from seeded generators), shards it with DistributedModelParallel
(t0 table-wise on rank 0, t1 row-wise, t2 data-parallel; the dense kernel) and feeds it its own batch
as a KeyedJaggedTensor with per-id weights (0.5, 0.75, 1.0, ...). The oracle is the unsharded
unweighted EmbeddingBagCollection with the same tables fed the same KeyedJaggedTensor: each pooled
embedding the plain sum of its ids' rows. Every feature's pooled output is compared within
|sharded - unsharded| <= 64 units of float32 roundoff x (|unsharded| + max|unsharded|): a bag sums
at most 3 rows, so a few roundings at most separate two correct summation orders.

    python this_script.py            the KeyedJaggedTensor carries per-id weights
    python this_script.py --control  the same ids without weights (the same module, plan and comparison)

    exit 0: the sharded module matches the unsharded one (prints OK)
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


WORLD_SIZE, WIDTH, SEED = 2, 4, 53
TABLES = {"t0": (10, "f0"), "t1": (12, "f1"), "t2": (8, "f2")}  # name: (rows, feature)
BATCHES = [  # per rank, per feature: the ids of each sample
    {"f0": [[1, 4], [], [9]], "f1": [[0, 11, 5], [2], []], "f2": [[3], [7, 1], [6]]},
    {"f0": [[0], [3, 3], []], "f1": [[8], [], [1, 10]], "f2": [[], [2, 4, 5], [0]]},
]
UNITS_OF_ROUNDOFF = 64


def kjt(rank: int, weighted: bool):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = BATCHES[rank]
    ids = [i for rows in batch.values() for row in rows for i in row]
    return KeyedJaggedTensor(keys=list(batch), values=torch.tensor(ids),
                             lengths=torch.tensor([len(row) for rows in batch.values() for row in rows]),
                             weights=torch.tensor([0.5 + 0.25 * (n % 4) for n in range(len(ids))]) if weighted else None)


def build_ebc():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=WIDTH, feature_names=[feature],
                                  pooling=PoolingType.SUM) for name, (rows, feature) in TABLES.items()]
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=False, device=torch.device("cpu"))
    with torch.no_grad():
        for key, tensor in ebc.state_dict().items():
            tensor.copy_(initial_weight(key.split(".")[-2]))
    return ebc


def initial_weight(table: str) -> torch.Tensor:
    rows = TABLES[table][0]
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(SEED + int(table[1:])))


def sharded(rank: int, weighted: bool, result: dict) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    result["stage"] = "sharding the EmbeddingBagCollection"
    ebc = build_ebc()
    generators = {"t0": sp.table_wise(rank=0, compute_kernel="dense"), "t1": sp.row_wise(compute_kernel="dense"),
                  "t2": sp.data_parallel()}
    plan = sp.construct_module_sharding_plan(ebc, generators, local_size=WORLD_SIZE, world_size=WORLD_SIZE,
                                             device_type="cpu")
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"": plan}), sharders=sp.get_default_sharders())
    with torch.no_grad():  # DMP initialises the shards itself: give them the unsharded tables' weights
        for key, value in dmp.state_dict().items():
            pieces = ([(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
                      if isinstance(value, ShardedTensor) else [(value, [0, 0])])
            for piece, (row, col) in pieces:
                piece.copy_(initial_weight(key.split(".")[-2])[row:row + piece.shape[0], col:col + piece.shape[1]])
    result["stage"] = "the forward of the sharded EmbeddingBagCollection"
    output = dmp(kjt(rank, weighted))
    output = output.wait() if hasattr(output, "wait") else output
    actual = output.to_dict()
    expected = build_ebc()(kjt(rank, weighted)).to_dict()
    for feature, want in expected.items():
        compare(result, f"the pooled output of {feature!r}", actual[feature].detach(), want.detach())


def compare(result: dict, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    result["compared"] += 1
    difference = first_difference(actual, expected, roundoff_bound(expected, UNITS_OF_ROUNDOFF), oracle="unsharded")
    if difference:
        result["problems"].append(f"{what}: {difference}")


def run_rank(rank: int, scratch: str, weighted: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        sharded(rank, weighted, result)
    except Exception as exc:
        where = library_frame(exc) if result["stage"] != "starting the process group" else ""
        result.update({"raised" if where else "error": f"{type(exc).__name__}: {exc}".replace("\n", " "),
                       "where": where, "traceback": traceback.format_exc()})
    finish_rank(scratch, result, failed=bool(result.get("raised") or result.get("error")))


def main() -> int:
    weighted = not control_requested("a KJT without weights, which torchrec gets right")
    results = run_ranks(run_rank, (weighted,), WORLD_SIZE)
    label = f"the sharded unweighted EmbeddingBagCollection fed a KJT {'with' if weighted else 'without'} weights"
    raised = [r for r in results if r.get("raised")]
    if raised:
        r = raised[0]
        return reproduced(f"{label}: torchrec raised {r['raised']} on rank {r['rank']} during {r['stage']}, in {r['where']}")
    problems = [f"rank {r['rank']}, {p}" for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced(f"{label} differs from the unsharded one: {'; '.join(problems[:3])}")
    errors = [r for r in results if r.get("error")]
    if errors:
        return cannot_run(f"rank {errors[0]['rank']} during {errors[0].get('stage', '?')}: {errors[0]['error']}\n"
                          f"{errors[0].get('traceback', '')}")
    return ok(f"{label} matches the unsharded one ({sum(r['compared'] for r in results)} tensors compared)")


if __name__ == "__main__":
    run_script(main)
