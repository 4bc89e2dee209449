"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue gradient-accumulation-flush-without-sync (listed for torchrec >=1.8,<1.10).

GradientAccumulationWrapper learning of the end of the data from StopIteration steps the dense
optimizer for a window that ended inside the epoch with gradients accumulated under DDP no_sync and
never all-reduced (_flush_accumulated_gradients promises a gradient sync it does not make): the
replicated dense parameters diverge across ranks.

What to do instead: pass is_last_batch=True with the last batch of the epoch (this script's
--mark-last), or make every epoch a multiple of the accumulation window.

The script spawns 2 ranks (gloo, CPU). Each builds a model of one EmbeddingBagCollection (table t0,
16 x 4, SUM, table-wise on rank 0, fused SGD lr 0.1 applied in backward) and a dense nn.Linear(4, 1)
under DistributedModelParallel (DDP over the dense part, dense SGD lr 0.1 through a
KeyedOptimizerWrapper), and trains it with GradientAccumulationWrapper(TrainPipelineSparseDist,
num_steps=2) over one epoch of 3 batches per rank, progress() until StopIteration. Its oracle is the
unsharded model on every rank, trained on all ranks' batches with the plain meaning of the setup:
the per-sample squared-error losses of every rank summed, every gradient divided by the world size
(DDP's average, torchrec's all-to-all gradient division); the table updated after each batch (the
fused optimizer), the dense layer once per window of 2 batches and once for the last, short window.
After each window it compares the dense weights and each rank's shard of t0 (|a - b| <= 64 units of
float32 roundoff x (|b| + max|b|): the same sums in another order).

    python this_script.py              3 batches: the last window (batch 2) ends inside the epoch
    python this_script.py --control    4 batches: every window ends on a step that syncs
    python this_script.py --mark-last  3 batches, is_last_batch=True with the last (the workaround)

    exit 0: both ranks train like the unsharded model
    exit 1: they do not, or torchrec raised (the message says where)
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


WORLD_SIZE, ROWS, DIM, BATCH, LR, NUM_STEPS = 2, 16, 4, 3, 0.1, 2
UNITS_OF_ROUNDOFF = 64


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        config = EmbeddingBagConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f0"], pooling=PoolingType.SUM)
        self.ebc = EmbeddingBagCollection(tables=[config], device=torch.device("cpu"))
        self.dense = torch.nn.Linear(DIM, 1)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            self.ebc.embedding_bags["t0"].weight.copy_(torch.randn(ROWS, DIM, generator=g))
            self.dense.weight.copy_(torch.randn(1, DIM, generator=g))
            self.dense.bias.zero_()

    def forward(self, batch):
        logits = self.dense(self.ebc(batch.sparse_features).values()).squeeze(1)
        return (logits - batch.labels) ** 2, logits.detach()  # per-sample losses, as torchrec's pipelines expect


def batch_of(step: int, rank: int):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 4, (BATCH,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    sparse = KeyedJaggedTensor(keys=["f0"], values=values, lengths=lengths.int())
    return Batch(dense_features=torch.zeros(BATCH, 1), sparse_features=sparse, labels=torch.randn(BATCH, generator=g))


def windows(num_batches: int) -> list:
    """The index of the last batch of each window: the dense step comes after it."""
    return [i for i in range(num_batches) if (i + 1) % NUM_STEPS == 0 or i == num_batches - 1]


def reference(num_batches: int) -> list:
    """(table, dense weight, dense bias) after each window, unsharded, on every rank's batches."""
    model = Model()
    table, weight, bias = model.ebc.embedding_bags["t0"].weight, model.dense.weight, model.dense.bias
    accumulated = [torch.zeros_like(weight), torch.zeros_like(bias)]
    records = []
    for step in range(num_batches):
        loss = sum(model(batch_of(step, rank))[0].sum() for rank in range(WORLD_SIZE))
        grads = [g / WORLD_SIZE for g in torch.autograd.grad(loss, [table, weight, bias])]
        with torch.no_grad():
            table -= LR * grads[0]  # the fused optimizer: every batch
            accumulated = [a + g for a, g in zip(accumulated, grads[1:])]
            if step in windows(num_batches):  # the dense optimizer: once per window
                weight -= LR * accumulated[0]
                bias -= LR * accumulated[1]
                accumulated = [torch.zeros_like(weight), torch.zeros_like(bias)]
                records.append(tuple(t.detach().clone() for t in (table, weight, bias)))
    return records


def shard(rank: int):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = Model()
    initial = model.ebc.embedding_bags["t0"].weight.detach().clone()
    apply_optimizer_in_backward(torch.optim.SGD, list(model.ebc.parameters()), {"lr": LR})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, {"t0": table_wise(rank=0)}, local_size=WORLD_SIZE,
                                                               world_size=WORLD_SIZE, device_type="cpu")})
    sharded = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=plan, sharders=get_default_sharders())
    with torch.no_grad():
        for piece in local_table(sharded):
            piece.copy_(initial)  # table-wise: the one shard is the whole table
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(sharded.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    return sharded, dense


def local_table(sharded) -> list:
    return [s.tensor for s in sharded.state_dict()["ebc.embedding_bags.t0.weight"].local_shards()]


def snapshot(sharded) -> dict:
    state = sharded.state_dict()
    pieces = {"table t0": local_table(sharded), "dense.weight": [state["dense.weight"]], "dense.bias": [state["dense.bias"]]}
    return {name: [p.detach().clone() for p in tensors] for name, tensors in pieces.items()}


def train(rank: int, num_batches: int, mark_last: bool) -> list:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.train_pipeline.gradient_accumulation import GradientAccumulationConfig, GradientAccumulationWrapper

    sharded, dense = shard(rank)
    pipeline = TrainPipelineSparseDist(sharded, dense, torch.device("cpu"))
    wrapped = GradientAccumulationWrapper(pipeline, dense, sharded, GradientAccumulationConfig(num_steps=NUM_STEPS))
    data, done, records = iter([batch_of(step, rank) for step in range(num_batches)]), 0, []
    while done <= num_batches:  # bounded: one call more than there are batches must raise StopIteration
        try:
            wrapped.progress(data, is_last_batch=mark_last and done == num_batches - 1)
        except StopIteration:
            break
        if done in windows(num_batches)[:-1]:
            records.append((done, snapshot(sharded)))
        done += 1
    return records + [(num_batches - 1, snapshot(sharded))]  # the last window: stepped by now, one way or another


def compare(rank: int, records: list, expected: list) -> list:
    problems = []
    for (step, actual), oracle in zip(records, expected):
        for (name, pieces), want in zip(actual.items(), oracle):
            for piece in pieces:
                difference = first_difference(piece.detach(), want, roundoff_bound(want, UNITS_OF_ROUNDOFF), oracle="unsharded")
                if difference:
                    problems.append(f"after batch {step} (end of a window), rank {rank}, {name}: {difference}")
    return problems


def run_rank(rank: int, scratch: str, num_batches: int, mark_last: bool) -> None:
    result, stage = {"rank": rank}, "starting the process group"
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        stage = "computing the unsharded oracle"
        expected = reference(num_batches)
        stage = "training through GradientAccumulationWrapper"
        records = train(rank, num_batches, mark_last)
        result.update(problems=compare(rank, records, expected), compared=len(records))
    except Exception as exc:
        in_torchrec = stage.startswith("training") and library_frame(exc)
        result.update({"raised" if in_torchrec else "error": f"{type(exc).__name__}: {exc}", "stage": stage,
                       "where": library_frame(exc), "traceback": traceback.format_exc(limit=-6)})
    finish_rank(scratch, result, failed="raised" in result or "error" in result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--control", action="store_true", help="4 batches: the nearest configuration torchrec computes right")
    parser.add_argument("--mark-last", action="store_true", help="the workaround: is_last_batch=True with the last batch")
    args = parser.parse_args()
    num_batches = 4 if args.control else 3
    how = f"{num_batches} batches, accumulation over {NUM_STEPS}, " + ("is_last_batch=True with the last" if args.mark_last
                                                                       else "the end learnt from StopIteration")
    results = run_ranks(run_rank, (num_batches, args.mark_last), WORLD_SIZE)
    raised = [r for r in results if "raised" in r]
    if raised:
        return reproduced(f"torchrec raised {raised[0]['raised']} on rank {raised[0]['rank']} ({how}), in {raised[0]['where']}")
    errors = [r for r in results if "error" in r]
    if errors:
        return cannot_run("; ".join(f"rank {r['rank']} while {r.get('stage', '?')}: {r['error']}\n{r.get('traceback', '')}" for r in errors))
    problems = [p for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced(f"GradientAccumulationWrapper ({how}): the replicated dense layer leaves the unsharded oracle "
                          f"({len(problems)} difference(s)): " + "; ".join(problems[:3]))
    return ok(f"GradientAccumulationWrapper ({how}) trains like the unsharded model on both ranks "
              f"({sum(r['compared'] for r in results)} windows compared)")


if __name__ == "__main__":
    run_script(main)
