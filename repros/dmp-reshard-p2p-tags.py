"""Known torchrec issue dmp-reshard-p2p-tags (listed for torchrec >=1.8,<1.10).

DistributedModelParallel.reshard tags each point-to-point transfer with Python's hash() of a tuple
holding the table's name (torchrec/distributed/sharding/dynamic_sharding.py, _generate_tag); it
differs between processes (unless they share PYTHONHASHSEED), so on gloo, which matches sends to
receives by tag, the reshard waits forever. Workaround: start every rank with the same
PYTHONHASHSEED (e.g. export PYTHONHASHSEED=0 before the launcher).

The script starts 2 ranks (torch.multiprocessing "spawn", gloo on CPU, process-group timeout 15 s),
each with its own PYTHONHASHSEED (1 and 2: two processes as a launcher gives them, made
deterministic), builds a model with an EmbeddingBagCollection of t0 (8 x 4, f0) and t1 (8 x 4, f1) (seeded
torch.randn, SUM pooling, fused SGD) under a dense layer, shards it with DistributedModelParallel (t0 table-wise on rank
0, t1 table-wise on rank 1), then moves t0 to rank 1 with dmp.reshard (the delta computed by
torchrec's output_sharding_plans_delta) and feeds each rank a batch. The oracle is the unsharded
module with the same weights: after the reshard, rank 1 must hold both tables (rank 0 none), with
exactly their initial weights, and each rank's pooled outputs must equal the unsharded module's within
|sharded - oracle| <= 1e-5 * (1 + |oracle|) (sums of at most 3 float32 rows of order 1). Each rank
also reports the tag torchrec computes for t0's transfer (rank 0 -> rank 1); the ranks must agree.
The parent waits at most 120 s and ends any rank still running, so the script cannot hang.

    python this_script.py            different PYTHONHASHSEEDs: exit 1 (REPRODUCED) when the reshard fails
                                     (gloo times out waiting for the transfer) or the outputs differ
    python this_script.py --control  the same PYTHONHASHSEED on both ranks: exit 0 (OK)
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


WORLD_SIZE, DIM, DEADLINE_S = 2, 4, 120
TABLES = {"t0": (8, "f0"), "t1": (8, "f1")}  # name: (rows, feature)
BATCHES = [{"f0": [[1, 2], [], [3]], "f1": [[5], [0, 7], []]}, {"f0": [[4], [5, 6], [7]], "f1": [[1], [], [2, 2]]}]


def initial_weight(table: str) -> torch.Tensor:
    return torch.randn(TABLES[table][0], DIM, generator=torch.Generator().manual_seed(int(table[1:]) + 1))


class Model(torch.nn.Module):
    """The EBC under a dense layer, as in a model: DistributedModelParallel wraps the model in DDP, and
    reshard reaches it through DDP's .module."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc, self.dense = build(), torch.nn.Linear(DIM, 1)

    def forward(self, features) -> dict:
        return self.ebc(features).to_dict()


def build():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=[f])
                                            for n, (r, f) in TABLES.items()])
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(initial_weight(name.split(".")[-2]))
    apply_optimizer_in_backward(torch.optim.SGD, list(module.parameters()), {"lr": 0.1})
    return module


def kjt(ids: dict):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(ids), values=torch.tensor([i for rows in ids.values() for row in rows for i in row]),
                             lengths=torch.tensor([len(row) for rows in ids.values() for row in rows]))


def module_plan(module, t0_rank: int):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise

    return construct_module_sharding_plan(module, {"t0": table_wise(rank=t0_rank, compute_kernel="fused"),
                                                   "t1": table_wise(rank=1, compute_kernel="fused")},
                                          local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")


def reshard_and_compare(rank: int, result: dict) -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding import dynamic_sharding
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    model = Model()
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"ebc": module_plan(model.ebc, 0)}), sharders=get_default_sharders())
    with torch.no_grad():
        for key, value in tables(dmp):
            for shard in value.local_shards():
                shard.tensor.copy_(initial_weight(key.split(".")[-2]))
    # The tag of t0's weight transfer, rank 0 -> rank 1 (source, shard, local shard, destination, name, optimizer state).
    result["tag"] = dynamic_sharding._generate_tag(0, 0, 0, 1, "t0", False)
    deltas = dynamic_sharding.output_sharding_plans_delta(dmp.plan.plan, {"ebc": module_plan(build(), 1)}, True)
    result["stage"] = "moving t0 from rank 0 to rank 1 with DistributedModelParallel.reshard"
    dmp.reshard(deltas)
    result["stage"] = "reading the tables and feeding the resharded model"
    held = sorted(key.split(".")[-2] for key, value in tables(dmp) if value.local_shards())
    result["compared"] += 1
    if held != (["t0", "t1"] if rank == 1 else []):  # the new plan: both tables on rank 1
        result["problems"].append(f"rank {rank} holds {held} after the reshard, not what the new plan places there")
    for key, value in tables(dmp):
        for shard in value.local_shards():
            result["compared"] += 1
            if not torch.equal(shard.tensor, initial_weight(key.split(".")[-2])):
                result["problems"].append(f"rank {rank}: table {key.split('.')[-2]} after the reshard is not its weights")
    actual = dmp(kjt(BATCHES[rank]))
    for key, want in build()(kjt(BATCHES[rank])).to_dict().items():
        result["compared"] += 1
        difference = first_difference(actual[key].detach(), want.detach(), 1e-5 * (1 + want.detach().abs()),
                                      oracle="the unsharded module's")
        if difference:
            result["problems"].append(f"rank {rank}: output {key!r} differs from the unsharded module's: {difference}")


def tables(dmp) -> list:
    return [(key, value) for key, value in dmp.state_dict().items() if ".embedding_bags." in key]


def run_rank(rank: int, scratch: str) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "setting up"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch, timeout_s=15)
        result["stage"] = "sharding the module"
        reshard_and_compare(rank, result)
        result["done"] = True
    except Exception as exc:
        in_torchrec = result["stage"] != "setting up" and library_frame(exc, TORCHREC + ("torch/distributed",))
        result["raised" if in_torchrec else "error"] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
    with open(os.path.join(scratch, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)
    if result.get("done"):
        dist.destroy_process_group()
    os._exit(0)  # do not wait for a transfer gloo will never complete


def main() -> int:
    control = control_requested("the same PYTHONHASHSEED on both ranks")
    # Not run_ranks: each rank's interpreter starts under its own PYTHONHASHSEED, set while it is spawned.
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        processes, saved = [], os.environ.get("PYTHONHASHSEED")
        try:
            for rank in range(WORLD_SIZE):
                os.environ["PYTHONHASHSEED"] = "1" if control else str(rank + 1)  # read by the new interpreter
                processes.append(context.Process(target=run_rank, args=(rank, scratch)))
                processes[-1].start()
        finally:
            if saved is None:
                del os.environ["PYTHONHASHSEED"]
            else:
                os.environ["PYTHONHASHSEED"] = saved
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=DEADLINE_S)
        for process in processes:
            process.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results = [read_result(scratch, rank, f"still running after {DEADLINE_S} s") for rank in range(WORLD_SIZE)]
    return verdict(results)


def verdict(results: list) -> int:
    tags = ", ".join(f"rank {r['rank']}: {r['tag']}" for r in results if "tag" in r)
    raised = [r for r in results if r.get("raised")]
    if raised:
        return reproduced(f"rank {raised[0]['rank']} raised while {raised[0]['stage']}: {raised[0]['raised']} "
                          f"(torchrec's P2P tag for the transfer of t0, rank 0 -> rank 1: {tags})")
    problems = [p for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced("after DistributedModelParallel.reshard, " + "; ".join(problems[:4]) + f" (P2P tags: {tags})")
    errors = [r for r in results if not r.get("done")]
    if errors:
        return cannot_run(f"rank {errors[0]['rank']} while {errors[0].get('stage', 'unknown')}: {errors[0].get('error')}")
    return ok(f"after DistributedModelParallel.reshard the tables and outputs match the unsharded module "
              f"({sum(r['compared'] for r in results)} tensors compared; P2P tags {tags})")


if __name__ == "__main__":
    run_script(main)
