"""Known torchrec issue one-row-shard-row-states-as-single-values (listed for torchrec >=1.8,<1.10).

A row-wise shard of one row trained by an optimizer with per-row states besides momentum1
(counter-based row-wise Adagrad's prev_iter and row_counter, row-wise RMSprop's prev_iter):
ShardedEmbeddingBagCollection's fused optimizer state_dict (batched_embedding_kernel
get_sharded_optim_state: nelement() == 1 and state_key != 'momentum1') takes the one-element state
for a single-value state and gives it the metadata of one value per rank (size world_size, offset
rank), so a checkpoint of it overlaps another shard's rows. Found by the gate's seed 2 on 2 hosts x 2
ranks (10 rows over 4 ranks: 3, 3, 3, 1). Workaround (what paritykit's draws do): give a row-sharded
table at least two rows in every shard (rows >= 2 x the ranks it is cut over).

The script spawns 2 ranks (torch.multiprocessing, gloo on CPU), builds an EmbeddingBagCollection with
table t0 (3 x 4) sharded row-wise and t1 (8 x 4) table-wise on rank 0, marks both with fused
counter-based row-wise Adagrad (apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad,
weight_decay_mode=COUNTER, counter halflife 1, counter weight decay L2)), wraps it in
DistributedModelParallel and reads the fused optimizer's state_dict. The oracle is the metadata a
correct sharded state_dict must carry for a per-row state of t0, computed by hand from the plan:
row-wise cuts the 3 rows into blocks of ceil(3 / 2) = 2, so every per-row state (momentum1,
prev_iter, row_counter) is a ShardedTensor of global size [3] with shards [0, 2) on rank 0 and [2, 3)
on rank 1, the same as the table's rows. Metadata is compared exactly (integers).

    python this_script.py            t0 of 3 rows (shards of 2 and 1 rows): exit 1 (REPRODUCED) when a
                                     state's metadata differs from the plan's
    python this_script.py --control  t0 of 4 rows (shards of 2 and 2 rows), the same comparison: exit 0 (OK)
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


WORLD_SIZE, DIM = 2, 4
ROW_STATES = ("momentum1", "prev_iter", "row_counter")  # fbgemm's per-row states of counter-based row-wise Adagrad


def fbgemm_config(argument: str):
    """fbgemm's class for one argument of its TBE, read from the annotation of the TBE class torchrec
    imports (fbgemm_gpu comes with torchrec; the script imports torch and torchrec only)."""
    from torchrec.distributed.batched_embedding_kernel import SplitTableBatchedEmbeddingBagsCodegen

    annotation = SplitTableBatchedEmbeddingBagsCodegen.__init__.__annotations__[argument]
    return next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))


def expected_metadata(rows: int) -> dict:
    """Row-wise sharding by hand: blocks of ceil(rows / world size) rows, rank by rank."""
    block = -(-rows // WORLD_SIZE)
    shards = [[[r * block], [min(block, rows - r * block)]] for r in range(WORLD_SIZE)]
    return {"global_size": [rows], "shards": shards}


def run_rank(rank: int, scratch: str, rows: int) -> None:
    result = {"rank": rank}
    try:
        start_process_group(rank, WORLD_SIZE, scratch)
        result["states"] = optimizer_state_metadata(rows)
    except Exception as exc:
        result["raised" if library_frame(exc) else "error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}"
    finish_rank(scratch, result, failed="states" not in result)


def optimizer_state_metadata(rows: int) -> dict:
    """{state: (global size, [[offset, size] of every shard], [offset, size] of this rank's shard)} for t0."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=rows, embedding_dim=DIM, feature_names=["f0"]),
                                            EmbeddingBagConfig(name="t1", num_embeddings=8, embedding_dim=DIM, feature_names=["f1"])])
    counter = fbgemm_config("counter_based_regularization")
    counter_mode = type(counter.__dataclass_fields__["counter_weight_decay_mode"].default)
    apply_optimizer_in_backward(RowWiseAdagrad, list(module.parameters()), {
        "lr": 0.1, "eps": 1e-3, "weight_decay": 0.1, "weight_decay_mode": fbgemm_config("weight_decay_mode").COUNTER,
        "counter_based_regularization": counter(counter_weight_decay_mode=counter_mode.L2, counter_halflife=1)})
    plan = construct_module_sharding_plan(module, {"t0": row_wise(compute_kernel="fused"), "t1": table_wise(rank=0, compute_kernel="fused")},
                                          local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    sharded = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    states = next(v for k, v in sharded.fused_optimizer.state_dict()["state"].items() if k.endswith("t0.weight"))
    found = {}
    for key, value in states.items():
        name = key.split(".")[-1]
        if name in ROW_STATES:
            metadata = value.metadata()
            found[name] = (list(metadata.size),
                           sorted([list(s.shard_offsets), list(s.shard_sizes)] for s in metadata.shards_metadata),
                           [[list(s.metadata.shard_offsets), list(s.metadata.shard_sizes)] for s in value.local_shards()])
    return found


def verdict(results: list, rows: int) -> int:
    for result in results:
        if result.get("raised"):
            return reproduced(f"torchrec raised on rank {result['rank']}: {result['raised']}")
        if "states" not in result or result.get("error"):
            return cannot_run(f"rank {result['rank']}: {result.get('error', 'it wrote no result')}")
        missing = [s for s in ROW_STATES if s not in result["states"]]
        if missing:
            return cannot_run(f"rank {result['rank']}: t0's fused optimizer state has no {missing} (nothing to compare)")
    expected = expected_metadata(rows)
    problems = []
    for result in results:
        rank = result["rank"]
        want = [expected["global_size"], expected["shards"], [expected["shards"][rank]]]
        for name in ROW_STATES:
            got = result["states"][name]
            if got != want:
                problems.append(f"rank {rank}, state t0.{name}: global size {got[0]}, shards [[offset], [size]] {got[1]}, "
                                f"this rank's {got[2]}; the plan gives {want[0]}, {want[1]}, {want[2]}")
    if problems:
        return reproduced(f"t0 ({rows} rows row-wise over {WORLD_SIZE} ranks) has per-row optimizer states whose sharded "
                          f"metadata is not the plan's ({len(problems)} difference(s)): " + "; ".join(problems[:3]))
    return ok(f"every per-row optimizer state of t0 ({rows} rows row-wise over {WORLD_SIZE} ranks) carries the plan's "
              f"metadata ({len(ROW_STATES)} states x {WORLD_SIZE} ranks compared)")


def main() -> int:
    rows = 4 if control_requested("t0 of 4 rows: two rows in every shard") else 3
    return verdict(run_ranks(run_rank, (rows,), WORLD_SIZE), rows)


if __name__ == "__main__":
    run_script(main)
