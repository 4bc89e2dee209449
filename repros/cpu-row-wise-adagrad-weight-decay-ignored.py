"""Known torchrec issue cpu-row-wise-adagrad-weight-decay-ignored (listed for fbgemm-gpu-cpu >=1.8,<1.10).

fbgemm's CPU row-wise Adagrad kernel applies no weight decay in modes L2 and DECOUPLE (weights and
accumulator are those of weight_decay=0); the counter-based mode applies it. torchrec hands
weight_decay and weight_decay_mode to fbgemm's TBE as given; the CPU kernel then leaves them out.

The script builds an EmbeddingBagCollection with one table t0 (6 x 4, seeded torch.randn, SUM
pooling) read by feature f0, marks it with apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad,
..., {"lr": 0.1, "eps": 1e-3, "weight_decay": 0.1, "weight_decay_mode": L2, then DECOUPLE}), shards it
table-wise on one gloo rank with DistributedModelParallel (fused kernel) and runs one training step.
The oracle is the unsharded module under a hand computation of row-wise Adagrad with weight decay,
on each looked-up row r (gradient g, accumulator s from 0, m = lr / (sqrt(s) + eps)):
    L2:        s += mean((g + wd w)^2);  w = (1 - m wd) w - m g
    DECOUPLE:  s += mean(g^2);           w = (1 - lr wd) w - m g
The table after the step is compared within |sharded - oracle| <= 1e-5 * (1 + |oracle|): a correct
float32 computation of these few operations on values of order 1 is off by ~1e-7, while the decay
moves each looked-up weight by lr * wd * w (order 1e-2). A REPRODUCED line also says whether the
sharded table equals the same oracle with weight_decay=0.

    python this_script.py            modes L2 and DECOUPLE: exit 1 (REPRODUCED) when the decay is missing
    python this_script.py --control  the same decay through counter-based regularization (weight_decay_mode
                                     COUNTER, counter_weight_decay_mode L2 / DECOUPLE, counter_halflife 1:
                                     on a row's first touch its counter is 1, freq = halflife / counter = 1,
                                     the same update as above), which the CPU kernel applies: exit 0 (OK)
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


ROWS, DIM, LR, EPS, WD = 6, 4, 0.1, 1e-3, 0.1
IDS = [[0, 1], [2], [1, 4]]  # f0, one list per sample; rows 3 and 5 are not read


def fbgemm_config(argument: str):
    """fbgemm's class for one argument of its TBE, read from the annotation of the TBE class torchrec
    imports (fbgemm_gpu comes with torchrec; the script imports torch and torchrec only)."""
    from torchrec.distributed.batched_embedding_kernel import SplitTableBatchedEmbeddingBagsCodegen

    annotation = SplitTableBatchedEmbeddingBagsCodegen.__init__.__annotations__[argument]
    return next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))


def optimizer_kwargs(mode: str, control: bool) -> dict:
    weight_decay_mode = fbgemm_config("weight_decay_mode")
    kwargs = {"lr": LR, "eps": EPS, "weight_decay": WD}
    if not control:
        return {**kwargs, "weight_decay_mode": weight_decay_mode[mode]}
    counter = fbgemm_config("counter_based_regularization")
    counter_mode = type(counter.__dataclass_fields__["counter_weight_decay_mode"].default)
    return {**kwargs, "weight_decay_mode": weight_decay_mode.COUNTER,
            "counter_based_regularization": counter(counter_weight_decay_mode=counter_mode[mode], counter_halflife=1)}


def build():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM,
                                                               feature_names=["f0"], pooling=PoolingType.SUM)])
    with torch.no_grad():
        next(iter(module.parameters())).copy_(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7)))
    return module


def batch():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f0"], values=torch.tensor([i for row in IDS for i in row]),
                             lengths=torch.tensor([len(row) for row in IDS]))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return (output * torch.randn(output.shape, generator=torch.Generator().manual_seed(11))).sum()


def oracle(mode: str, weight_decay: float) -> torch.Tensor:
    """The table after one step of the unsharded module under a hand row-wise Adagrad with decay."""
    module = build()
    weight = next(iter(module.parameters()))
    loss_of(module(batch()).to_dict()["f0"]).backward()
    with torch.no_grad():
        for row in sorted({i for r in IDS for i in r}):
            w, g = weight[row].clone(), weight.grad[row]
            effective = g + weight_decay * w if mode == "L2" else g
            m = LR / ((effective * effective).mean().sqrt() + EPS)
            keep = 1 - m * weight_decay if mode == "L2" else 1 - LR * weight_decay
            weight[row] = keep * w - m * g
    return weight.detach().clone()


def sharded_run(mode: str, control: bool) -> torch.Tensor:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = build()
    apply_optimizer_in_backward(RowWiseAdagrad, list(module.parameters()), optimizer_kwargs(mode, control))
    plan = construct_module_sharding_plan(module, {"t0": table_wise(rank=0, compute_kernel="fused")},
                                          local_size=1, world_size=1, device_type="cpu")
    sharded = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    table = next(v for k, v in sharded.state_dict().items() if k.endswith("t0.weight")).local_shards()[0].tensor
    with torch.no_grad():
        table.copy_(next(iter(build().parameters())))
    loss_of(sharded(batch()).to_dict()["f0"]).backward()
    return table.detach().clone()


def difference(what: str, actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Beyond |actual - oracle| <= 1e-5 * (1 + |oracle|): "what: where and how much", else ""."""
    found = first_difference(actual, expected, 1e-5 * (1 + expected.abs()))
    return f"{what}: {found}" if found else ""


def main() -> int:
    control = control_requested("the same decay through counter-based regularization")
    torch.set_num_threads(1)
    problems, compared = [], 0
    try:
        expected = {mode: (oracle(mode, WD), oracle(mode, 0.0)) for mode in ("L2", "DECOUPLE")}
    except Exception as exc:
        return cannot_run(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        with OneRank():
            for mode, (decayed, undecayed) in expected.items():
                actual = sharded_run(mode, control)
                compared += actual.numel()
                problem = difference(f"step 0, table t0 after the step, weight decay mode {mode}", actual, decayed)
                if problem:
                    same = "equals" if not difference("", actual, undecayed) else "differs from"
                    problems.append(f"{problem} (the sharded table {same} the oracle with weight_decay=0)")
    except Exception as exc:
        return verdict_of_raise(exc, "the sharded EBC")
    how = "counter-based regularization (COUNTER, halflife 1)" if control else "weight_decay_mode L2 and DECOUPLE"
    if problems:
        return reproduced(f"row-wise Adagrad with {how} left out the weight decay; " + "; ".join(problems))
    return ok(f"the sharded EBC matches the unsharded one under a hand row-wise Adagrad with weight decay, "
              f"through {how} ({compared} elements)")


if __name__ == "__main__":
    run_script(main)
