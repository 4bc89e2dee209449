"""Known torchrec issue fused-ebc-plan-generators-give-dense-kernel (listed for torchrec >=1.8,<1.10).

torchrec's sharding-plan generators (sharding_plan.table_wise, column_wise, ...; what
construct_module_sharding_plan calls) given no compute_kernel choose the fused kernel only for a
parameter that carries an in-backward optimizer. A FusedEmbeddingBagCollection's tables carry none (the
module holds its optimizer itself), so they get the dense kernel, which FusedEmbeddingBagCollectionSharder
does not offer (it lists only the fused kernels for these types). DistributedModelParallel shards the
module so anyway, and the optimizer given to the module is never applied: its tables never train.

The script builds FusedEmbeddingBagCollection(one table of 6 x 4, optimizer_type=torch.optim.SGD, lr 0.5)
on one rank (gloo), shards it with DistributedModelParallel and the plan
construct_module_sharding_plan(module, {"t0": table_wise(rank=0)}), and trains one step: a bag of ids
[1, 2] and a bag [3], loss = the sum of the outputs. Its oracle is SGD written out: each looked-up row
moves by -lr x the number of times it was looked up (the gradient of a sum pool is one per lookup);
the other rows stay. Exact comparison (one float32 subtraction each).

    python this_script.py            the plan's generator without a compute_kernel
    python this_script.py --control  table_wise(rank=0, compute_kernel="fused")

    exit 0: the table moved as SGD says (prints OK)
    exit 1: it did not, or torchrec raised (prints REPRODUCED and where)
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


def train_one_step(kernel) -> dict:
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    module = FusedEmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=6, embedding_dim=4, feature_names=["f0"])],
                                         optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.5}, device=torch.device("cpu"))
    plan = construct_module_sharding_plan(module, {"t0": table_wise(rank=0, compute_kernel=kernel)}, world_size=1, device_type="cpu")
    model = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                     plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    before = _table(model)
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    model(kjt).values().sum().backward()
    return {"kernel": plan["t0"].compute_kernel, "before": before, "after": _table(model)}


def _table(model) -> torch.Tensor:
    weight = model.state_dict()["embedding_bags.t0.weight"]
    return torch.cat([shard.tensor for shard in weight.local_shards()]).detach().clone()


def main() -> int:
    control = control_requested('table_wise(rank=0, compute_kernel="fused"), where the table trains')
    kernel = "fused" if control else None
    what = f"FusedEmbeddingBagCollection(SGD, lr 0.5) sharded table-wise with table_wise(rank=0, compute_kernel={kernel!r})"
    try:
        with OneRank():
            result = train_one_step(kernel)
    except Exception as exc:
        return verdict_of_raise(exc, what)
    expected = result["before"].clone()
    expected[1] -= 0.5
    expected[2] -= 0.5
    expected[3] -= 0.5
    if not torch.equal(result["after"], expected):
        moved = sorted(int(row) for row in (result["after"] != result["before"]).any(dim=1).nonzero().flatten())
        return reproduced(f"{what} (the plan gave it the {result['kernel']!r} kernel): after one step of SGD the rows that moved "
                          f"are {moved}, SGD moves rows [1, 2, 3] by -0.5 each")
    return ok(f"{what}: the plan gave it the {result['kernel']!r} kernel and one step moved rows 1, 2, 3 by -0.5 as SGD does")


if __name__ == "__main__":
    run_script(main)
