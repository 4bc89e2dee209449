"""Known torchrec issue fp-ebc-root-position-weights-not-averaged (listed for torchrec >=1.8,<1.10).

a FeatureProcessedEmbeddingBagCollection that is itself the model DistributedModelParallel wraps does not
average its position weights' gradients over the ranks: DDP wraps the sharded FP-EBC, whose forward returns
torchrec's awaitable rather than tensors, so DDP (static_graph=True, DMP's default) never runs its delayed
all-reduce of the first iteration, and each rank steps its replica of the position weights with its own
gradient: the replicas drift apart.

What to do instead: hold the FP-EBC in a module that returns tensors (its pooled embeddings by key, as a
model's dense part does), or give DMP a DefaultDataParallelWrapper(static_graph=False).

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU, a file:// rendezvous in a temporary
directory, 60 s timeouts). Each builds the same FP-EBC (a weighted EBC of two SUM tables t0, t1 reading
f0, f1, position weights held by a PositionWeightedModuleCollection of length 3, every weight from seeded
generators), shards it with DistributedModelParallel (t0 table-wise on rank 0, t1 table-wise on rank 1),
loads the same weights, and trains two steps on its own batch: the loss the sum of the pooled embeddings
times fixed coefficients, the tables stepped by fused SGD, the position weights by torch's SGD (lr 0.1).
The oracle is the unsharded FP-EBC trained in one process on both ranks' batches with the mean of the two
ranks' gradients (what data parallelism promises), stepped by torch's SGD. The position weights of every
rank are compared within |sharded - unsharded| <= 64 units of float32 roundoff x (|unsharded| +
max|unsharded|): two correct summation orders differ by a few roundings.

    python this_script.py            the FP-EBC is the model DMP wraps
    python this_script.py --control  the same FP-EBC held in a module returning its pooled embeddings by key

    exit 0: every rank's position weights are the unsharded ones (prints OK)
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


WORLD_SIZE, WIDTH, LENGTH, SEED, LR, STEPS = 2, 4, 3, 7, 0.1, 2
TABLES = {"t0": (6, "f0"), "t1": (5, "f1")}  # name: (rows, feature)
BATCHES = [  # per rank, per step, per feature: the ids of each sample
    [{"f0": [[1, 4, 2], [], [5]], "f1": [[0], [2, 3], []]}, {"f0": [[3], [0, 1], []], "f1": [[4, 4, 1], [], [2]]}],
    [{"f0": [[0], [2, 2], [1, 3]], "f1": [[], [1, 0, 2], [3]]}, {"f0": [[], [5, 4, 3], [2]], "f1": [[1], [0], [4, 3]]}],
]
UNITS_OF_ROUNDOFF = 64


def kjt(rank: int, step: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = BATCHES[rank][step]
    ids = [i for rows in batch.values() for row in rows for i in row]
    return KeyedJaggedTensor(keys=list(batch), values=torch.tensor(ids),
                             lengths=torch.tensor([len(row) for rows in batch.values() for row in rows]))


def seeded(*shape: int, offset: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(SEED + offset)) + 0.5


class Pooled(torch.nn.Module):
    """The --control model: the FP-EBC's pooled embeddings by key."""

    def __init__(self, fp_ebc: torch.nn.Module) -> None:
        super().__init__()
        self.fp = fp_ebc

    def forward(self, features):
        return self.fp(features).to_dict()


def build(held: bool) -> torch.nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=WIDTH, feature_names=[feature])
               for name, (rows, feature) in TABLES.items()]
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=True, device=torch.device("cpu"))
    processors = PositionWeightedModuleCollection({feature: LENGTH for _rows, feature in TABLES.values()})
    model = FeatureProcessedEmbeddingBagCollection(ebc, processors)
    return Pooled(model) if held else model


def initial_state(model: torch.nn.Module) -> dict:
    state = {}
    for n, key in enumerate(sorted(model.state_dict())):
        state[key] = seeded(*model.state_dict()[key].shape, offset=n)
    return state


def loss_of(output) -> torch.Tensor:
    pooled = output.to_dict() if hasattr(output, "to_dict") else output
    return sum((k + 1) * pooled[f].sum() for k, f in enumerate(sorted(pooled)))


def unsharded(held: bool) -> dict:
    """The oracle: both ranks' batches, the mean of their gradients, torch's SGD on everything."""
    model = build(held)
    model.load_state_dict(initial_state(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        (sum(loss_of(model(kjt(rank, step))) for rank in range(WORLD_SIZE)) / WORLD_SIZE).backward()
        optimizer.step()
    return {key: value.detach().clone() for key, value in model.state_dict().items() if "position" in key}


def sharded(rank: int, held: bool, result: dict) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    result["stage"] = "sharding the FP-EBC"
    model = build(held)
    model.load_state_dict(initial_state(model))
    fp = model.fp if held else model
    tables = [p for n, p in fp.named_parameters() if "embedding_bags" in n]
    apply_optimizer_in_backward(torch.optim.SGD, tables, {"lr": LR})
    generators = {"t0": sp.table_wise(rank=0), "t1": sp.table_wise(rank=1)}
    plan = sp.construct_module_sharding_plan(fp, generators, local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"fp" if held else "": plan}), sharders=sp.get_default_sharders())
    state = initial_state(build(held))
    with torch.no_grad():  # DMP initialises the shards itself: give them the unsharded weights
        for key, value in dmp.state_dict().items():
            pieces = ([(s.tensor, s.metadata.shard_offsets) for s in value.local_shards()]
                      if isinstance(value, ShardedTensor) else [(value, [0] * value.dim())])
            for piece, offsets in pieces:
                piece.copy_(state[key][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))])
    dense = [p for n, p in dmp.named_parameters() if "position" in n]
    optimizer = torch.optim.SGD(dense, lr=LR)
    result["stage"] = "training the sharded FP-EBC"
    for step in range(STEPS):
        optimizer.zero_grad()
        output = dmp(kjt(rank, step))
        output = output.wait() if hasattr(output, "wait") else output
        loss_of(output).backward()
        optimizer.step()
    expected = unsharded(held)
    for key, value in dmp.state_dict().items():
        if "position" in key:
            compare(result, f"position weights {key!r} after {STEPS} steps", value.detach(), expected[key])


def compare(result: dict, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    result["compared"] += 1
    difference = first_difference(actual, expected, roundoff_bound(expected, UNITS_OF_ROUNDOFF), oracle="unsharded")
    if difference:
        result["problems"].append(f"{what}: {difference}")


def run_rank(rank: int, scratch: str, held: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        sharded(rank, held, result)
    except Exception as exc:
        where = library_frame(exc) if result["stage"] != "starting the process group" else ""
        result.update({"raised" if where else "error": f"{type(exc).__name__}: {exc}".replace("\n", " "),
                       "where": where, "traceback": traceback.format_exc()})
    finish_rank(scratch, result, failed=bool(result.get("raised") or result.get("error")))


def main() -> int:
    held = control_requested("the FP-EBC held in a module, which torchrec gets right")
    results = run_ranks(run_rank, (held,), WORLD_SIZE)
    label = f"the FP-EBC {'held in a module' if held else 'as the model'} sharded by DMP"
    raised = [r for r in results if r.get("raised")]
    if raised:
        r = raised[0]
        return reproduced(f"{label}: torchrec raised {r['raised']} on rank {r['rank']} during {r['stage']}, in {r['where']}")
    problems = [f"rank {r['rank']}, {p}" for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced(f"{label} trains other position weights than the unsharded one: {'; '.join(problems[:3])}")
    errors = [r for r in results if r.get("error")]
    if errors or not all(r.get("compared") for r in results):
        bad = errors[0] if errors else next(r for r in results if not r.get("compared"))
        return cannot_run(f"rank {bad['rank']} during {bad.get('stage', '?')}: {bad.get('error', 'nothing compared')}\n"
                          f"{bad.get('traceback', '')}")
    return ok(f"{label} trains the unsharded position weights ({sum(r['compared'] for r in results)} tensors compared)")


if __name__ == "__main__":
    run_script(main)
