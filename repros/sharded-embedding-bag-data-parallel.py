"""Known torchrec issue sharded-embedding-bag-data-parallel (listed for torchrec >=1.8,<1.10).

a plain nn.EmbeddingBag placed data-parallel by EmbeddingBagSharder cannot be wrapped by DDP:
ShardedEmbeddingBag.named_parameters(recurse=False) yields nothing, so DDP finds no parameter.

What to do instead: shard a plain nn.EmbeddingBag row-wise, or put its table in an
EmbeddingBagCollection (whose data-parallel placement works).

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU, a file:// rendezvous in a temporary
directory, 60 s timeouts). Each builds a model holding a plain nn.EmbeddingBag (12 rows x 8 columns,
mode SUM, include_last_offset=True, weights from a seeded generator), shards it with
DistributedModelParallel and torchrec's EmbeddingBagSharder data-parallel (the dense kernel, which
DMP wraps in DDP, trained by torch's SGD, lr 0.1), and runs one training step on its own batch (ids,
offsets ending with the number of ids, per-id weights). The oracle is the unsharded nn.EmbeddingBag
with the same weights: its output on the rank's batch, and its table after one SGD step on the sum of both ranks' losses divided by
the world size (torchrec's default gradient division). The loss is sum(output * g), g a fixed
pattern. Outputs and this rank's part of the table are compared within
|sharded - unsharded| <= 64 units of float32 roundoff x (|unsharded| + max|unsharded|): a bag sums
at most 3 rows, so a few roundings at most separate two correct summation orders.

    python this_script.py            data-parallel
    python this_script.py --control  row-wise, fused SGD (the same model, batches, step and comparison)

    exit 0: the sharded bag matches the unsharded one (prints OK)
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


WORLD_SIZE, ROWS, WIDTH, LR, SEED = 2, 12, 8, 0.1, 55
BATCHES = [  # per rank: bags of (id, weight)
    [[(3, 0.25), (7, 0.75)], [], [(11, 1.25)]],
    [[(0, 0.75)], [(5, 0.25), (5, 1.25), (9, 0.75)], [(2, 0.25)]],
]
UNITS_OF_ROUNDOFF = 64


def bag_inputs(rank: int) -> tuple:
    """(ids, offsets ending with the number of ids, per-id weights) of the rank's batch."""
    bags = BATCHES[rank]
    offsets = [0]
    for bag in bags:
        offsets.append(offsets[-1] + len(bag))
    return (torch.tensor([i for bag in bags for i, _ in bag]), torch.tensor(offsets),
            torch.tensor([w for bag in bags for _, w in bag]))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(ROWS, WIDTH, mode="sum", include_last_offset=True)
        with torch.no_grad():
            self.bag.weight.copy_(torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(SEED)))

    def forward(self, ids, offsets, weights):
        return self.bag(ids, offsets, per_sample_weights=weights)


def upstream(shape) -> torch.Tensor:
    """g: the gradient of the loss with respect to the output, a fixed pattern."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(SEED + 1))


def unsharded(rank: int) -> tuple:
    """The oracle: the rank's output, and the table after one SGD step on the ranks' summed losses / world size."""
    model = Model()
    outputs = [model(*bag_inputs(r)) for r in range(WORLD_SIZE)]
    (sum((out * upstream(out.shape)).sum() for out in outputs) / WORLD_SIZE).backward()
    with torch.no_grad():
        table = model.bag.weight - LR * model.bag.weight.grad
    return outputs[rank].detach(), table


def placement(control: bool):
    from torchrec.distributed import sharding_plan as sp

    return sp.row_wise(compute_kernel="fused") if control else sp.data_parallel()


def sharded(rank: int, control: bool, result: dict) -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.distributed.utils import EmbOptimType

    result["stage"] = "sharding the bag"
    sharder = EmbeddingBagSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    model = Model()
    plan = construct_module_sharding_plan(model.bag, per_param_sharding={"weight": placement(control)}, sharder=sharder,
                                          local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"bag": plan}), sharders=[sharder])
    with torch.no_grad():  # DMP initialises the shards itself: give them the unsharded bag's weights
        for piece, offsets in local_pieces(dmp):
            piece.copy_(Model().bag.weight[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))])
    result["stage"] = "the forward and backward of the sharded bag"
    output = dmp(*bag_inputs(rank))
    output = output.wait() if hasattr(output, "wait") else output
    (output * upstream(output.shape)).sum().backward()
    dense = [p for p in dmp.parameters() if p.grad is not None]  # a fused table updates in its backward
    if dense:
        torch.optim.SGD(dense, lr=LR).step()
    expected_output, expected_table = unsharded(rank)
    compare(result, "the output", output.detach(), expected_output)
    result["stage"] = "reading the sharded table after the step"
    for piece, offsets in local_pieces(dmp):
        window = expected_table[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))]
        compare(result, f"the table after the step, shard at {list(offsets)}", piece.detach(), window)


def local_pieces(dmp):
    """(this rank's piece of the table, its offsets in the table): each local shard, or the replica."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for value in dmp.state_dict().values():
        if isinstance(value, ShardedTensor):
            yield from ((shard.tensor, tuple(shard.metadata.shard_offsets)) for shard in value.local_shards())
        else:
            yield value, (0,) * value.dim()


def compare(result: dict, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    result["compared"] += 1
    difference = first_difference(actual, expected, roundoff_bound(expected, UNITS_OF_ROUNDOFF), oracle="the unsharded bag")
    if difference:
        result["problems"].append(f"{what}: {difference}")


def run_rank(rank: int, scratch: str, control: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        sharded(rank, control, result)
    except Exception as exc:
        where = library_frame(exc) if result["stage"] != "starting the process group" else ""
        result.update({"raised" if where else "error": f"{type(exc).__name__}: {exc}".replace("\n", " "),
                       "where": where, "traceback": traceback.format_exc()})
    finish_rank(scratch, result, failed=bool(result.get("raised") or result.get("error")))


def main() -> int:
    control = control_requested("row-wise, which torchrec gets right")
    results = run_ranks(run_rank, (control,), WORLD_SIZE)
    label = "row-wise" if control else "data-parallel"
    raised = [r for r in results if r.get("raised")]
    if raised:
        r = raised[0]
        return reproduced(f"the {label} sharded nn.EmbeddingBag: torchrec raised {r['raised']} on rank {r['rank']} "
                          f"during {r['stage']}, in {r['where']}")
    problems = [f"rank {r['rank']}, {p}" for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced(f"the {label} sharded nn.EmbeddingBag differs from the unsharded one: {'; '.join(problems[:3])}")
    errors = [r for r in results if r.get("error")]
    if errors:
        return cannot_run(f"rank {errors[0]['rank']} during {errors[0].get('stage', '?')}: {errors[0]['error']}\n"
                          f"{errors[0].get('traceback', '')}")
    compared = sum(r["compared"] for r in results)
    return ok(f"the {label} sharded nn.EmbeddingBag matches the unsharded one ({compared} tensors compared)")


if __name__ == "__main__":
    run_script(main)
