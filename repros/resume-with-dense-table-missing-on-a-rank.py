"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue resume-with-dense-table-missing-on-a-rank (listed for torchrec >=1.8,<1.10).

A dense-kernel table with no shard on a rank leaves it an empty placeholder parameter that training
never gives a gradient (so no optimizer state) but KeyedOptimizer.init_state() does: load_state_dict
of the trained optimizer's state_dict then fails on that rank (ValueError: Different parameter
count).

What to do instead: give every rank a shard of each dense-kernel table (row-wise, or column-wise
over every rank), or use the fused kernel for tables placed on some ranks only.

The script spawns 2 ranks (gloo, CPU). Each builds an EmbeddingBagCollection of two tables (t0 on
f0, t1 on f1, 12 x 4 each, SUM) and a dense nn.Linear(8, 1) under DistributedModelParallel, the
tables with the dense kernel, t0 table-wise on rank 0 and t1 table-wise on rank 1, and trains every
parameter with torch's Adam (lr 0.05) through a KeyedOptimizerWrapper for 4 steps. Before step 2
it resumes as torchrec's KeyedOptimizer documents: state_dict(), a fresh KeyedOptimizerWrapper,
init_state(), load_state_dict(). Its oracle is the unsharded model on every rank, trained without
interruption by torch's Adam on all ranks' batches: the per-sample squared-error losses of every
rank summed and every gradient divided by the world size (DDP's average, torchrec's all-to-all
gradient division). After each step it compares the dense layer and this rank's shards of the
tables (|a - b| <= 64 units of float32 roundoff x (|b| + max|b|): the same sums in another order).

    python this_script.py            t0 table-wise on rank 0, t1 table-wise on rank 1
    python this_script.py --control  t0 and t1 row-wise: every rank holds a shard of each

    exit 0: the resumed run trains like the unsharded model on both ranks
    exit 1: it does not, or torchrec raised (the message says where)
    exit 2: the script itself could not run
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


WORLD_SIZE, ROWS, DIM, BATCH, LR, STEPS, RESUME_AT = 2, 12, 4, 3, 0.05, 4, 2
TABLES = ("t0", "t1")
UNITS_OF_ROUNDOFF = 64


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        configs = [EmbeddingBagConfig(name=t, num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{i}"],
                                      pooling=PoolingType.SUM) for i, t in enumerate(TABLES)]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        self.dense = torch.nn.Linear(DIM * len(TABLES), 1)
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(initial_weight(name))

    def forward(self, sparse, labels):
        return (self.dense(self.ebc(sparse).values()).squeeze(1) - labels) ** 2


def initial_weight(name: str) -> torch.Tensor:
    shapes = {**{f"ebc.embedding_bags.{t}.weight": (ROWS, DIM) for t in TABLES},
              "dense.weight": (1, DIM * len(TABLES)), "dense.bias": (1,)}
    seed = sorted(shapes).index(name) + 11
    return torch.randn(shapes[name], generator=torch.Generator().manual_seed(seed))


def batch_of(step: int, rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 4, (len(TABLES) * BATCH,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    keys = [f"f{i}" for i in range(len(TABLES))]
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.int()), torch.randn(BATCH, generator=g)


def reference() -> list:
    """{parameter name: value} after each step: the unsharded model, Adam, every rank's batches."""
    model = Model()
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    records = []
    for step in range(STEPS):
        adam.zero_grad()
        loss = sum(model(*batch_of(step, rank)).sum() for rank in range(WORLD_SIZE))
        (loss / WORLD_SIZE).backward()
        adam.step()
        records.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return records


def shard(row_wise: bool):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, row_wise as rw, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    placements = {t: rw(compute_kernel="dense") if row_wise else table_wise(rank=i, compute_kernel="dense")
                  for i, t in enumerate(TABLES)}
    model = Model()
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, placements, local_size=WORLD_SIZE,
                                                               world_size=WORLD_SIZE, device_type="cpu")})
    sharded = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=plan, sharders=get_default_sharders())
    with torch.no_grad():
        for name, piece, offsets in local_pieces(sharded):
            piece.copy_(initial_weight(name)[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))])
    return sharded


def adam(sharded):
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    return KeyedOptimizerWrapper(dict(sharded.named_parameters()), lambda params: torch.optim.Adam(params, lr=LR))


def local_pieces(sharded):
    """(parameter name, this rank's piece of it, its offsets) for every shard and replica on this rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for name, value in sharded.state_dict().items():
        if isinstance(value, ShardedTensor):
            for piece in value.local_shards():
                yield name, piece.tensor, tuple(piece.metadata.shard_offsets)
        else:
            yield name, value, (0,) * value.dim()


def train(rank: int, row_wise: bool, expected: list, result: dict) -> None:
    sharded = shard(row_wise)
    optimizer = adam(sharded)
    for step in range(STEPS):
        if step == RESUME_AT:
            result["stage"] = f"resuming the optimizer before step {step} (init_state, load_state_dict)"
            saved = optimizer.state_dict()
            optimizer = adam(sharded)
            optimizer.init_state()
            optimizer.load_state_dict(saved)
        result["stage"] = f"training step {step}"
        optimizer.zero_grad()
        sparse, labels = batch_of(step, rank)
        sharded(sparse, labels).sum().backward()
        optimizer.step()
        for name, piece, offsets in local_pieces(sharded):
            want = expected[step][name][tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))]
            result["compared"] += 1
            difference = first_difference(piece.detach(), want, roundoff_bound(want, UNITS_OF_ROUNDOFF), oracle="unsharded")
            if difference:
                result["problems"].append(f"after step {step}, rank {rank}, {name} shard at {list(offsets)}: {difference}")


def run_rank(rank: int, scratch: str, row_wise: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "starting the process group"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        result["stage"] = "computing the unsharded oracle"
        expected = reference()
        result["stage"] = "sharding the model"
        train(rank, row_wise, expected, result)
    except Exception as exc:
        in_torchrec = result["stage"] not in ("starting the process group", "computing the unsharded oracle") and library_frame(exc)
        result.update({"raised" if in_torchrec else "error": f"{type(exc).__name__}: {exc}", "where": library_frame(exc),
                       "traceback": traceback.format_exc(limit=-6)})
    finish_rank(scratch, result, failed="raised" in result or "error" in result)


def main() -> int:
    row_wise = control_requested("row-wise tables: the nearest configuration torchrec computes right")
    how = "t0, t1 row-wise (dense kernel)" if row_wise else "t0 table-wise on rank 0, t1 on rank 1 (dense kernel)"
    results = run_ranks(run_rank, (row_wise,), WORLD_SIZE)
    raised = [r for r in results if "raised" in r]
    if raised:
        return reproduced(f"torchrec raised {raised[0]['raised']} on rank {raised[0]['rank']} while {raised[0]['stage']} "
                          f"({how}; {len(raised)} of {WORLD_SIZE} ranks raised), in {raised[0]['where']}")
    errors = [r for r in results if "error" in r]
    if errors:
        return cannot_run("; ".join(f"rank {r['rank']} while {r.get('stage', '?')}: {r['error']}\n{r.get('traceback', '')}" for r in errors))
    problems = [p for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced(f"resumed before step {RESUME_AT} ({how}), the model leaves the unsharded oracle "
                          f"({len(problems)} difference(s)): " + "; ".join(problems[:3]))
    return ok(f"resumed before step {RESUME_AT} ({how}), both ranks train like the unsharded model with torch's Adam "
              f"({sum(r['compared'] for r in results)} tensors compared)")


if __name__ == "__main__":
    run_script(main)
