"""Known torchrec issue dmp-copy (listed for torchrec >=1.8,<1.10).

DistributedModelParallel.copy fails on a gloo-sharded model: torchrec's sharded_model_copy patches
ProcessGroupNCCL (absent from a CPU-only torch) and cannot deep-copy the ProcessGroup itself (it
gives ProcessGroupNCCL, ProcessGroupGloo and Work a no-copy __deepcopy__, not the ProcessGroup that
ShardingEnv.from_process_group(dist.group.WORLD) holds).

The script builds an EmbeddingBagCollection with tables t0 (6 x 4) and t1 (8 x 4) (seeded torch.randn,
SUM pooling), shards them (t0 table-wise, t1 row-wise) with DistributedModelParallel on one gloo
rank, calls dmp.copy(torch.device("cpu")) and feeds the copy one batch. The oracle is the unsharded
module with the same weights: the copy's pooled outputs must equal its outputs within
|copy - oracle| <= 1e-5 * (1 + |oracle|) (a sum of at most 3 float32 rows of order 1: a correct
result is off by ~1e-7).

    python this_script.py            dmp.copy(cpu), then the copy's forward: exit 1 (REPRODUCED) when
                                     copy raises or the copy's outputs differ
    python this_script.py --control  the same comparison on the DMP itself, not copied: exit 0 (OK)
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


TABLES = {"t0": (6, "f0"), "t1": (8, "f1")}  # name: (rows, feature); 4 columns each
IDS = {"f0": [[0, 1], [2], [1, 4, 5]], "f1": [[7], [], [3, 3]]}


def build():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=4, feature_names=[feature])
                                            for name, (rows, feature) in TABLES.items()])
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(initial_weight(name.split(".")[-2]))
    return module


def initial_weight(table: str) -> torch.Tensor:
    return torch.randn(TABLES[table][0], 4, generator=torch.Generator().manual_seed(int(table[1:]) + 1))


def batch():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(IDS), values=torch.tensor([i for rows in IDS.values() for row in rows for i in row]),
                             lengths=torch.tensor([len(row) for rows in IDS.values() for row in rows]))


def sharded():
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    module = build()
    plan = construct_module_sharding_plan(module, {"t0": table_wise(rank=0), "t1": row_wise()},
                                          local_size=1, world_size=1, device_type="cpu")
    dmp = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            value.local_shards()[0].tensor.copy_(initial_weight(key.split(".")[-2]))
    return dmp


def compare(actual: dict, expected: dict) -> list:
    problems = []
    for key, want in expected.items():
        got = actual.get(key)
        difference = "missing" if got is None else first_difference(got, want, 1e-5 * (1 + want.abs()))
        if difference:
            problems.append(f"output {key!r}: {difference}")
    return problems


def main() -> int:
    control = control_requested("the DMP itself, not its copy")
    what = "the DistributedModelParallel (not copied)" if control else "DistributedModelParallel.copy(cpu)"
    with OneRank():
        try:
            expected = {k: v.detach() for k, v in build()(batch()).to_dict().items()}
            dmp = sharded()
        except Exception as exc:
            return cannot_run(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            model = dmp if control else dmp.copy(torch.device("cpu"))
            actual = {k: v.detach() for k, v in model(batch()).to_dict().items()}
        except Exception as exc:
            return verdict_of_raise(exc, f"{what} of a gloo-sharded EBC")
    problems = compare(actual, expected)
    if problems:
        return reproduced(f"the outputs of {what} differ from the unsharded module's: " + "; ".join(problems))
    return ok(f"the outputs of {what} match the unsharded module's ({len(expected)} features compared)")


if __name__ == "__main__":
    run_script(main)
