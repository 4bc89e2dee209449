"""Known torchrec issue dcp-dense-kernel-optimizer-state (listed for torchrec >=1.8,<1.10).

The dense optimizer's state of a table sharded with the dense kernel (KeyedOptimizerWrapper over the
DMP's non-fused parameters) is a plain tensor of each rank's shard under one key on every rank:
torch.distributed.checkpoint takes it for a replicated tensor, so a save keeps one rank's copy and a
reload gives every rank that copy (silently wrong state), or the save fails when the ranks' shards
differ in shape.

What to do instead: train the table with the fused kernel (its state is a ShardedTensor), or save its
dense optimizer's state per rank (torch.save on every rank, reloaded on the same plan).

The script spawns 2 ranks (torch.multiprocessing, gloo on the CPU). It builds an EmbeddingBagCollection
of two 8 x 8 tables, both row-wise (4 rows a rank): t0 with the dense kernel, trained by the dense
optimizer torch.optim.Adagrad through torchrec's KeyedOptimizerWrapper; t1 with the fused kernel and
fused Adagrad (apply_optimizer_in_backward). It trains one step, saves the model and both optimizers'
state dicts with torch.distributed.checkpoint, builds a fresh DMP of the same plan with other weights,
creates the lazy optimizer state (init_state()), loads the checkpoint (dcp.load, then every
load_state_dict) and trains a second step.
--control: the same with t0 on the fused kernel (its Adagrad state is a ShardedTensor).

The oracle is the unsharded EBC trained with torch.optim.Adagrad on every rank's batch (the ranks'
losses summed, gradients divided by the world size, as torchrec divides them): after the reload each
rank's table shards and its Adagrad sums (fused or dense) must equal the unsharded ones at its rows,
and after step 1 too. Bound: |sharded - unsharded| <= 64 units of roundoff x (|unsharded| +
max|unsharded|): fbgemm's kernels sum in another order than torch's, a few roundings per step; another
rank's state is off by O(1).

    exit 0: the round trip matches the unsharded model (OK)
    exit 1: it does not, or torchrec / torch.distributed.checkpoint raised (REPRODUCED)
    exit 2: the script itself could not run (CANNOT RUN)
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

import zlib

WORLD_SIZE = 2
LR = 0.1
ROWS, DIM = 8, 8
TABLES = ("t0", "t1")  # table t<i> reads feature f<i>
BATCHES = [  # step s, rank r trains BATCHES[(s + r) % 3] (the features of TABLES)
    {"f0": [[1, 2], [], [3]], "f1": [[], [4], [2, 7]], "f2": [[0], [5, 5], []]},
    {"f0": [[4], [5, 6], []], "f1": [[1], [], [3]], "f2": [[], [1], [6]]},
    {"f0": [[7], [0, 0, 1], [2]], "f1": [[3, 3], [6], []], "f2": [[2], [], [7, 4]]},
]
STEPS, SAVE_AFTER = 2, 1
UNITS_OF_ROUNDOFF = 64
DEADLINE_S = 240
PLACES = TORCHREC + ("distributed/checkpoint",)  # a raise there is the checkpoint's, not the script's


def scenario(control: bool) -> dict:
    """The plan saved under and reloaded into (placements, kernels), optimizers and how the checkpoint is made."""
    plan = {"t0": ("row_wise",), "t1": ("row_wise",)}
    return {"plan": plan, "reload_plan": plan, "kernels": {"t0": "fused" if control else "dense", "t1": "fused"},
            "fused": "adagrad", "dense": "adagrad", "method": "dcp",
            "describe": "t0 row-wise on the fused kernel (control)" if control else "t0 row-wise on the dense kernel, dense Adagrad"}


def main() -> int:
    control = control_requested("the nearest configuration torchrec gets right")
    return verdict(run_ranks(run_rank, (control,), WORLD_SIZE, DEADLINE_S), scenario(control)["describe"])


def verdict(results: list, what: str) -> int:
    raised = [r for r in results if r.get("raised")]
    problems = [p for r in results for p in r.get("problems", [])]
    if raised:
        first = raised[0]
        return reproduced(f"{first['raised']} (rank {first['rank']}, {first['stage']}; {what}; in {first['where']})")
    if problems:
        return reproduced(f"the reloaded model differs from the unsharded one ({what}); {len(problems)} difference(s):\n"
                          + "\n".join(f"  {p}" for p in problems[:6]))
    errors = [r for r in results if r.get("error")]
    if errors:
        for r in errors:
            print(r.get("traceback", ""), file=sys.stderr)
        return cannot_run("; ".join(f"rank {r['rank']}: {r['error']}" for r in errors))
    compared = sum(r["compared"] for r in results)
    return ok(f"the checkpoint round trip matches the unsharded model ({what}; {compared} tensors compared)")


def run_rank(rank: int, scratch: str, control: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        case, directory = scenario(control), os.path.join(scratch, "checkpoint")
        os.makedirs(directory, exist_ok=True)
        result["stage"] = "training the unsharded reference"
        reference = train_unsharded(case)
        result["stage"] = "training the sharded model before the save"
        dmp, optimizers = shard(case, case["plan"], seed=1)
        for step in range(SAVE_AFTER):
            train_step(dmp, optimizers, step, rank)
        result["stage"] = "saving the checkpoint"
        save(dmp, optimizers, directory, case["method"])
        result["stage"] = "loading the checkpoint into a fresh DMP"
        dmp, optimizers = shard(case, case["reload_plan"], seed=2)  # other weights: a table the load misses cannot pass
        load(dmp, optimizers, directory, case["method"])
        compare_model(result, dmp, optimizers, reference[SAVE_AFTER - 1], f"after the reload (the state after step {SAVE_AFTER - 1})")
        result["stage"] = "training the reloaded model"
        for step in range(SAVE_AFTER, STEPS):
            train_step(dmp, optimizers, step, rank)
            compare_model(result, dmp, optimizers, reference[step], f"after step {step}")
        result.pop("stage")
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        where = library_frame(exc, PLACES)
        # Raised inside torchrec, fbgemm or torch.distributed.checkpoint: a reproduction. Elsewhere: this script failed.
        result.update({"raised" if where else "error": f"{type(exc).__name__}: {first_lines(str(exc))}", "where": where,
                       "traceback": traceback.format_exc(limit=-8)})
    finish_rank(scratch, result, failed=bool(result.get("raised") or result.get("error")))


# ---------------------------------------------------------------- the model, its batches and its loss


def build_ebc(seed: int):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=t, num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{t[1:]}"]) for t in TABLES]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():
        for key, value in ebc.state_dict().items():
            value.copy_(initial_weight(key, seed))
    return ebc


def initial_weight(key: str, seed: int) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(zlib.crc32(f"{key}/{seed}".encode())))


def table_of(key: str) -> str:
    return key.split(".")[-2]


def kjt(step: int, rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = BATCHES[(step + rank) % len(BATCHES)]
    keys = [f"f{t[1:]}" for t in TABLES]
    return KeyedJaggedTensor(keys=keys, values=torch.tensor([v for k in keys for row in batch[k] for v in row], dtype=torch.int64),
                             lengths=torch.tensor([len(row) for k in keys for row in batch[k]], dtype=torch.int32))


def loss_of(pooled) -> torch.Tensor:
    """A fixed function of every pooled element: each gets its own upstream gradient."""
    total = torch.zeros(())
    for key, value in sorted(pooled.to_dict().items()):
        weights = torch.randn(value.shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
        total = total + (value * weights).sum()
    return total


def torch_optimizer(name: str):
    known = {"sgd": (torch.optim.SGD, {}), "adagrad": (torch.optim.Adagrad, {"eps": 1e-8}), "adam": (torch.optim.Adam, {})}
    cls, extra = known[name]
    return cls, {**extra, "lr": LR}


# ---------------------------------------------------------------- the unsharded reference


def train_unsharded(case: dict) -> list:
    """Per step: {key: full tensor} of the tables and of the optimizers' state ("<key>/<state name>") after it."""
    from torchrec.distributed import comm_ops

    ebc = build_ebc(seed=1)
    replicated = {k for k, _ in ebc.named_parameters() if case["plan"][table_of(k)][0] == "data_parallel"}
    division = 1.0 / WORLD_SIZE if comm_ops.get_gradient_division() else 1.0
    fused = [p for k, p in ebc.named_parameters() if k not in replicated and case["kernels"][table_of(k)] == "fused"]
    dense = [p for p in ebc.parameters() if all(p is not f for f in fused)]
    optimizers = [cls(params, **kwargs) for params, (cls, kwargs) in
                  ((fused, torch_optimizer(case["fused"])), (dense, torch_optimizer(case["dense"]))) if params]
    records = []
    for step in range(STEPS):
        for opt in optimizers:
            opt.zero_grad()
        torch.stack([loss_of(ebc(kjt(step, rank))) for rank in range(WORLD_SIZE)]).sum().backward()
        with torch.no_grad():  # DDP averages replicated tables; the all-to-all divides the others
            for key, param in ebc.named_parameters():
                param.grad.mul_(1.0 / WORLD_SIZE if key in replicated else division)
        for opt in optimizers:
            opt.step()
        record = {}
        for key, param in ebc.named_parameters():
            record[key] = param.detach().clone()
            state = next(opt.state[param] for opt in optimizers if param in opt.state)
            record.update({f"{key}/{name}": value.clone() for name, value in state.items() if name != "step"})
        records.append(record)
    return records


# ---------------------------------------------------------------- the sharded model, its optimizers and its checkpoint


def placement(entry: tuple, kernel: str):
    from torchrec.distributed import sharding_plan as sp

    kind, *args = entry
    if kind == "column_wise":
        return sp.column_wise(ranks=list(args[0]), compute_kernel=kernel)
    if kind == "table_wise":
        return sp.table_wise(rank=args[0], compute_kernel=kernel)
    if kind == "row_wise":
        return sp.row_wise(compute_kernel=kernel)
    return sp.data_parallel()


def shard(case: dict, plan: dict, seed: int):
    """A DMP of ``plan`` with weights of ``seed``, and its optimizers {checkpoint entry: KeyedOptimizer}."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    ebc = build_ebc(seed)
    cls, kwargs = torch_optimizer(case["fused"])
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)  # the fused kernel's optimizer, as users set it
    generators = {t: placement(entry, case["kernels"][t]) for t, entry in plan.items()}
    module_plan = construct_module_sharding_plan(ebc, generators, local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"": module_plan}), sharders=get_default_sharders())
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            for piece, window in local_pieces(value):
                piece.copy_(initial_weight(key, seed)[window])
    optimizers = {"fused": dmp.fused_optimizer}
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    if params:
        dense_cls, dense_kwargs = torch_optimizer(case["dense"])
        optimizers["dense"] = KeyedOptimizerWrapper(params, lambda ps: dense_cls(ps, **dense_kwargs))
    return dmp, optimizers


def train_step(dmp, optimizers: dict, step: int, rank: int) -> None:
    for opt in optimizers.values():
        opt.zero_grad()
    loss_of(dmp(kjt(step, rank)).wait()).backward()  # the fused optimizer steps inside the backward
    for name, opt in optimizers.items():
        if name != "fused":
            opt.step()


def save(dmp, optimizers: dict, directory: str, method: str) -> None:
    state = {"model": dmp.state_dict(), **{name: opt.state_dict() for name, opt in optimizers.items()}}
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))
    else:
        torch.save(state, os.path.join(directory, f"rank{dist.get_rank()}.pt"))


def load(dmp, optimizers: dict, directory: str, method: str) -> None:
    """What a job does to resume: lazy optimizer state created, the checkpoint read, every load_state_dict."""
    for opt in optimizers.values():
        opt.init_state()
    if method == "dcp":
        import torch.distributed.checkpoint as dcp

        state = {"model": dmp.state_dict(), **{name: opt.state_dict() for name, opt in optimizers.items()}}
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    else:
        state = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"), weights_only=False)
    dmp.load_state_dict(state["model"])
    for name, opt in optimizers.items():
        opt.load_state_dict(state[name])


# ---------------------------------------------------------------- comparisons


def local_pieces(value):
    """(this rank's tensor, its window in the full tensor) for every local shard of a ShardedTensor, or the tensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        yield value, tuple(slice(0, n) for n in value.shape)
        return
    for piece in value.local_shards():
        meta = piece.metadata
        yield piece.tensor, tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes))


def canonical(name: str) -> str:
    """A parameter's name in the unsharded EBC (DMP and DDP add wrapper prefixes)."""
    return ".".join(part for part in name.split(".") if part not in ("_dmp_wrapped_module", "module"))


def compare_model(result: dict, dmp, optimizers: dict, expected: dict, when: str) -> None:
    """This rank's table shards and every optimizer's state of them against the unsharded reference's."""
    windows = {}
    for key, value in dmp.state_dict().items():
        compare(result, f"{when}, {key}", value, expected[key])
        windows[key] = [window for _, window in local_pieces(value)]
    for param, state in optimizers["fused"].state_dict()["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and name.endswith("momentum1"):  # Adagrad's sum of squared gradients
                compare(result, f"{when}, fused state {name}", value, expected[f"{canonical(param)}/sum"])
    for param, state in optimizers["dense"].state_dict()["state"].items() if "dense" in optimizers else ():
        key = canonical(param)
        for name, value in state.items():
            if name != "step":  # a dense-kernel shard's state is a plain tensor of this rank's rows: at its window
                window = windows[key][0] if value.shape != expected[f"{key}/{name}"].shape and len(windows[key]) == 1 else None
                compare(result, f"{when}, dense state {key}/{name}", value, expected[f"{key}/{name}"], window)


def compare(result: dict, what: str, value, full: torch.Tensor, at_window: tuple | None = None) -> None:
    """``value`` (a ShardedTensor, or a plain tensor: whole, or at ``at_window``) against the full tensor."""
    for piece, window in local_pieces(value):
        window = at_window or window
        result["compared"] += 1
        wanted = full[window].double()
        difference = first_difference(piece.detach().double(), wanted, roundoff_bound(wanted, UNITS_OF_ROUNDOFF),
                                       origin=tuple(w.start for w in window), oracle="unsharded")
        if difference:
            result["problems"].append(f"rank {result['rank']}, {what}: {difference}")


if __name__ == "__main__":
    run_script(main)
