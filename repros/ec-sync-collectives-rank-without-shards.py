"""Known torchrec issue ec-sync-collectives-rank-without-shards (listed for torchrec >=1.8,<1.10).

A sharded EmbeddingCollection under torchrec_use_sync_collectives, where a rank holds no table of a
sharding type: all2all_sequence_sync (torchrec/distributed/comm_ops.py) flattens the embeddings only
when the rank holds a table of that type (local_T > 0), so it hands that rank's empty 2-D embeddings
to the functional all_to_all_single with element-counted splits, which it reads as rows; the output
split fails. Workaround: give every rank a shard of each sharding type the EC uses, or leave the sync
collectives off.

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU, process-group timeout 60 s),
switches torchrec.distributed.comm_ops.set_use_sync_collectives(True), builds an EmbeddingCollection
of t0 (10 x 8, f0), t1 (8 x 8, f1), t2 (8 x 8, f2) (seeded torch.randn), shards it with
DistributedModelParallel (fused kernel): t0 table-wise on rank 1, t1 and t2 column-wise with both shards on rank 0,
so rank 0 holds no table-wise table and rank 1 no column-wise one. Each rank feeds its own batch. The
oracle is the unsharded EmbeddingCollection with the same weights fed the same batch: each feature's
embeddings must equal it within |sharded - oracle| <= 1e-6 * (1 + |oracle|) (a lookup copies rows:
a correct result is exact; the bound only admits float32 roundoff).

    python this_script.py            the plan above: exit 1 (REPRODUCED) when torchrec raises or differs
    python this_script.py --control  the sync collectives with a shard of each type on every rank (t1
                                     table-wise on rank 0, t2 column-wise over ranks 0 and 1): exit 0 (OK)
    exit 2 (CANNOT RUN): the script itself failed.
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


WORLD_SIZE, DIM = 2, 8
TABLES = {"t0": (10, "f0"), "t1": (8, "f1"), "t2": (8, "f2")}  # name: (rows, feature)
BATCHES = [{"f0": [[1, 2], [], [3]], "f1": [[], [1], [2, 3]], "f2": [[0], [5, 5], []]},   # rank 0
           {"f0": [[4], [5, 6], []], "f1": [[1], [], []], "f2": [[], [], [7]]}]       # rank 1


def plan_generators(control: bool) -> dict:
    from torchrec.distributed.sharding_plan import column_wise, table_wise

    # The fused kernel: a sharded EC on the dense kernel fails on CPU anyway (known issue ec-dense-kernel).
    fused = {"compute_kernel": "fused"}
    if control:
        return {"t0": table_wise(rank=1, **fused), "t1": table_wise(rank=0, **fused), "t2": column_wise(ranks=[0, 1], **fused)}
    return {"t0": table_wise(rank=1, **fused), "t1": column_wise(ranks=[0, 0], **fused), "t2": column_wise(ranks=[0, 0], **fused)}


def initial_weight(table: str) -> torch.Tensor:
    return torch.randn(TABLES[table][0], DIM, generator=torch.Generator().manual_seed(int(table[1:]) + 1))


def build():
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    module = EmbeddingCollection(tables=[EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=[f])
                                         for n, (r, f) in TABLES.items()])
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(initial_weight(name.split(".")[-2]))
    return module


def kjt(ids: dict):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(ids), values=torch.tensor([i for rows in ids.values() for row in rows for i in row]),
                             lengths=torch.tensor([len(row) for rows in ids.values() for row in rows]))


def sharded_outputs(rank: int, control: bool) -> dict:
    from torchrec.distributed import comm_ops
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    comm_ops.set_use_sync_collectives(True)
    module = build()
    plan = construct_module_sharding_plan(module, plan_generators(control), local_size=WORLD_SIZE, world_size=WORLD_SIZE,
                                          device_type="cpu")
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            for shard in value.local_shards():
                rows, cols = shard.metadata.shard_offsets
                sizes = shard.metadata.shard_sizes
                shard.tensor.copy_(initial_weight(key.split(".")[-2])[rows:rows + sizes[0], cols:cols + sizes[1]])
    output = dmp(kjt(BATCHES[rank]))
    output = output.wait() if hasattr(output, "wait") else output
    return {key: jt.values().detach() for key, jt in output.items()}


def run_rank(rank: int, scratch: str, control: bool) -> None:
    result, stage = {"rank": rank, "problems": []}, "setting up"
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        expected = {k: jt.values().detach() for k, jt in build()(kjt(BATCHES[rank])).items()}
        stage = "sharding the EC and feeding it this rank's batch"
        actual = sharded_outputs(rank, control)
        for key, want in expected.items():
            got = actual.get(key)
            difference = "missing" if got is None else first_difference(got, want, 1e-6 * (1 + want.abs()))
            if difference:
                result["problems"].append(f"rank {rank}, output {key!r}: {difference}")
        result["compared"] = len(expected)
    except Exception as exc:
        # Raised in torchrec, fbgemm or the collectives torchrec waits on (torch.distributed): a reproduction.
        in_torchrec = stage != "setting up" and library_frame(exc, TORCHREC + ("torch/distributed",))
        result["raised" if in_torchrec else "error"] = f"{type(exc).__name__}: {exc} (while {stage})\n{traceback.format_exc(limit=-5)}"
    finish_rank(scratch, result, failed="compared" not in result)


def main() -> int:
    control = control_requested("a shard of each sharding type on every rank")
    results = run_ranks(run_rank, (control,), WORLD_SIZE)
    raised = [r for r in results if r.get("raised")]
    if raised:
        return reproduced(f"torchrec raised on rank {raised[0]['rank']} under sync collectives: {raised[0]['raised']}")
    problems = [p for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced("the sharded EC under sync collectives differs from the unsharded one: " + "; ".join(problems[:4]))
    errors = [r for r in results if r.get("error")]
    if errors:
        return cannot_run(f"rank {errors[0]['rank']}: {errors[0]['error']}")
    return ok(f"the sharded EC under sync collectives matches the unsharded one on every rank "
              f"({sum(r['compared'] for r in results)} outputs compared)")


if __name__ == "__main__":
    run_script(main)
