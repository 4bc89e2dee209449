"""Known torchrec issue ec-fused-optimizer-type-ignored (listed for torchrec >=1.8,<1.10).

A sharded EmbeddingCollection trains with the fused optimizer of the class given to
apply_optimizer_in_backward even when its keyword arguments name another (optimizer=EmbOptimType...:
EMA in-place row-wise Adagrad, row-wise RMSprop); the EmbeddingBagCollection sharder honours it.
Cause: EmbeddingCollectionSharder (torchrec/distributed/embedding.py, create_sharding_infos_by_sharding)
always overwrites optimizer_params["optimizer"] with optimizer_type_to_emb_opt_type(class); the EBC
sharder does so only when "optimizer" is not already set.

The script builds one table t0 (6 x 4, seeded torch.randn) read by feature f0, marks it with
apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ..., {"optimizer": EMAINPLACE_ROWWISE_ADAGRAD,
"emainplace_mode": step_ema=1, step_start=0, step_ema_coef=0.5, "lr": 0.1, "eps": 1e-3}), shards it
table-wise on one gloo rank with DistributedModelParallel (fused kernel) and runs one training step.
The oracle is the unsharded module under a hand computation of fbgemm's EMA in-place row-wise
Adagrad: at the forward of iteration 1 (1 % step_ema == 0, >= step_start), before the lookup, the
second half of the columns of every row moves toward the first half (slow += coef * (fast - slow));
then each looked-up row r steps s_r = mean(g_r^2), w_r -= lr * g_r / (sqrt(s_r) + eps). The module's
output and the table after the step are compared within |sharded - oracle| <= 1e-5 * (1 + |oracle|):
a correct float32 computation of these few operations on values of order 1 is off by a few units of
roundoff (~1e-7), while the missing EMA moves columns 2-3 by half the gap to columns 0-1 (order 1).

    python this_script.py            the EmbeddingCollection: exit 1 (REPRODUCED) when it differs
    python this_script.py --control  the same table, optimizer and oracle in an EmbeddingBagCollection
                                     (SUM pooling), whose sharder honours the type: exit 0 (OK)
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


ROWS, DIM, LR, EPS, STEP_EMA, STEP_START, COEF = 6, 4, 0.1, 1e-3, 1, 0, 0.5
IDS = [[0, 1], [2], [1, 4]]  # f0, one list per sample; rows 3 and 5 are not read


def fbgemm_config(argument: str):
    """fbgemm's class for one argument of its TBE, read from the annotation of the TBE class torchrec
    imports (fbgemm_gpu comes with torchrec; the script imports torch and torchrec only)."""
    from torchrec.distributed.batched_embedding_kernel import SplitTableBatchedEmbeddingBagsCodegen

    annotation = SplitTableBatchedEmbeddingBagsCodegen.__init__.__annotations__[argument]
    return next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))


def build(kind: str):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if kind == "ec":
        module = EmbeddingCollection(tables=[EmbeddingConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f0"])])
    else:
        module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM,
                                                                   feature_names=["f0"], pooling=PoolingType.SUM)])
    with torch.no_grad():
        next(iter(module.parameters())).copy_(initial_weight())
    return module


def initial_weight() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))


def batch():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f0"], values=torch.tensor([i for row in IDS for i in row]),
                             lengths=torch.tensor([len(row) for row in IDS]))


def output_of(kind: str, out) -> torch.Tensor:
    return out["f0"].values() if kind == "ec" else out.to_dict()["f0"]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return (output * torch.randn(output.shape, generator=torch.Generator().manual_seed(11))).sum()


def oracle(kind: str):
    """(output, table after the step): the unsharded module under a hand EMA in-place row-wise Adagrad."""
    module = build(kind)
    weight = next(iter(module.parameters()))
    with torch.no_grad():  # iteration 1: the EMA, before the lookup
        half = DIM // 2
        if 1 % STEP_EMA == 0 and 1 >= STEP_START:
            weight[:, half:] += COEF * (weight[:, :half] - weight[:, half:])
    output = output_of(kind, module(batch()))
    loss_of(output).backward()
    with torch.no_grad():
        for row in sorted({i for r in IDS for i in r}):
            g = weight.grad[row]
            s = (g * g).mean()
            weight[row] -= LR * g / (s.sqrt() + EPS)
    return output.detach(), weight.detach().clone()


def sharded_run(kind: str):
    from torchrec.distributed.batched_embedding_kernel import OptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = build(kind)
    ema = fbgemm_config("emainplace_mode")(step_ema=STEP_EMA, step_start=STEP_START, step_ema_coef=COEF)
    apply_optimizer_in_backward(RowWiseAdagrad, list(module.parameters()),
                                {"lr": LR, "eps": EPS, "optimizer": OptimType.EMAINPLACE_ROWWISE_ADAGRAD, "emainplace_mode": ema})
    plan = construct_module_sharding_plan(module, {"t0": table_wise(rank=0, compute_kernel="fused")},
                                          local_size=1, world_size=1, device_type="cpu")
    sharded = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    with torch.no_grad():
        next(v for k, v in sharded.state_dict().items() if k.endswith("t0.weight")).local_shards()[0].tensor.copy_(initial_weight())
    output = output_of(kind, sharded(batch()).wait() if kind == "ec" else sharded(batch()))
    loss_of(output).backward()
    table = next(v for k, v in sharded.state_dict().items() if k.endswith("t0.weight")).local_shards()[0].tensor
    return output.detach(), table.detach().clone()


def difference(what: str, actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Beyond |actual - oracle| <= 1e-5 * (1 + |oracle|): "what: where and how much", else ""."""
    found = first_difference(actual, expected, 1e-5 * (1 + expected.abs()))
    return f"{what}: {found}" if found else ""


def main() -> int:
    kind = "ebc" if control_requested("the EmbeddingBagCollection, which torchrec trains right") else "ec"
    name = {"ec": "EmbeddingCollection", "ebc": "EmbeddingBagCollection"}[kind]
    torch.set_num_threads(1)
    try:
        expected = oracle(kind)
    except Exception as exc:
        return cannot_run(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        with OneRank():
            actual = sharded_run(kind)
    except Exception as exc:
        return verdict_of_raise(exc, f"the sharded {name}")
    problems = [p for p in (difference("step 0, output of feature f0", actual[0], expected[0]),
                            difference("step 0, table t0 after the step", actual[1], expected[1])) if p]
    if problems:
        return reproduced(f"the sharded {name} did not train with EMA in-place row-wise Adagrad; " + "; ".join(problems))
    return ok(f"the sharded {name} matches the unsharded one under a hand EMA in-place row-wise Adagrad "
              f"(output and table, {expected[0].numel() + expected[1].numel()} elements)")


if __name__ == "__main__":
    run_script(main)
