"""Known torchrec issue delta-tracker-embedding-empty-lookup (listed for torchrec >=1.8,<1.10).

DistributedModelParallel's model delta tracker in EMBEDDING mode fails inside the forward of a
sharded EmbeddingCollection on a rank whose lookup of a sharding type gets no ids (a rank holding no
shard of a table-wise table): record_embeddings asserts embeddings.numel() % kjt.values().numel() == 0,
a modulo by zero. Workaround: track ids only (TrackingMode.ID_ONLY), or give every rank a shard of
every sharding type of the EmbeddingCollection that gets ids in every batch.

The script starts 2 ranks (torch.multiprocessing "spawn", gloo on CPU, process-group timeout 30 s),
builds an EmbeddingCollection of t0 (8 x 4, f0) and t1 (8 x 4, f1) (seeded torch.randn, fused SGD)
under a dense layer (torch.nn.Linear(4, 1)), shards it with DistributedModelParallel (t0 table-wise on
rank 0, t1 row-wise), starts the delta tracker (DeltaTrackerConfig(tracking_mode=EMBEDDING)) and
runs one forward of f0 = [[0, 4]] and f1 = [[1, 5]] on each rank, then reads get_unique(). The oracle
is the seeded table: each rank's read must list the ids its shards looked up (as local row ids) with
the seeded row of each. Rows compared with torch.equal (nothing was trained).
The parent waits at most 120 s and ends any rank still running.

    python this_script.py            t0 table-wise on rank 0: rank 1 looks up no id table-wise and
                                     torchrec raises inside the forward: exit 1 (REPRODUCED)
    python this_script.py --control  both tables row-wise (every rank's shards get ids): the reads hold
                                     the seeded rows: exit 0 (OK)
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


WORLD_SIZE, DIM, ROWS = 2, 4, 8
DEADLINE_S, COLLECTIVE_TIMEOUT_S = 120, 30  # the parent ends every rank after 120 s; a collective gives up after 30 s
IDS = {"f0": [0, 4], "f1": [1, 5]}  # one row per rank, the same on every rank: each row-wise block gets an id


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        torch.manual_seed(0)
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM,
                                                              feature_names=[f"f{i}"]) for i in range(2)])
        apply_optimizer_in_backward(torch.optim.SGD, list(self.ec.parameters()), {"lr": 0.1})
        self.dense = torch.nn.Linear(DIM, 1)

    def forward(self, features):
        looked_up = self.ec(features)
        return sum(self.dense(looked_up[key].values()).sum() for key in IDS)


def expected(rank: int, control: bool, seeded: dict) -> dict:
    """{table fqn: {local id: seeded row}} this rank's shards looked up (row-wise blocks of ROWS // WORLD_SIZE)."""
    block, found = ROWS // WORLD_SIZE, {}
    for table, feature in (("t0", "f0"), ("t1", "f1")):
        if table == "t0" and not control:
            rows = {i: seeded[table][i] for i in IDS[feature]} if rank == 0 else {}
        else:
            rows = {i - rank * block: seeded[table][i] for i in IDS[feature] if rank * block <= i < (rank + 1) * block}
        if rows:
            found[f"ec.embeddings.{table}"] = rows
    return found


def compare(rank: int, control: bool, result: dict) -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    model = Model()
    seeded = {name: param.detach().clone() for name, param in
              (("t0", model.ec.embeddings.t0.weight), ("t1", model.ec.embeddings.t1.weight))}
    placements = {"t0": row_wise() if control else table_wise(rank=0), "t1": row_wise()}
    plan = construct_module_sharding_plan(model.ec, placements, local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"ec": plan}))
    tracker = dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.EMBEDDING))
    features = KeyedJaggedTensor.from_lengths_sync(keys=list(IDS), values=torch.tensor(IDS["f0"] + IDS["f1"]),
                                                   lengths=torch.tensor([2, 2]))
    result["stage"] = "the forward with the tracker on"
    try:
        dmp(features)
    except Exception as exc:
        if library_frame(exc):
            result["problems"].append(f"rank {rank}: the forward raised {type(exc).__name__}: {exc} (in {library_frame(exc)})")
            return
        raise
    result["stage"] = "reading the tracker"
    found = tracker.get_unique()
    for fqn, rows in expected(rank, control, seeded).items():
        result["compared"] += len(rows)
        got = dict(zip(found[fqn].ids.tolist(), found[fqn].states)) if fqn in found else {}
        for local, row in rows.items():
            if local not in got or not torch.equal(got[local], row):
                result["problems"].append(f"rank {rank}, {fqn}, local id {local}: tracked {got.get(local)}, expected the seeded row {row}")


def run_rank(rank: int, scratch: str, control: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "setting up"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch, timeout_s=COLLECTIVE_TIMEOUT_S)
        result["stage"] = "sharding the model"
        compare(rank, control, result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc).strip()[:400]} ({traceback.extract_tb(exc.__traceback__)[-1].filename})"
    # A rank whose forward raised leaves at once: the other waits in the output all-to-all.
    finish_rank(scratch, result, failed=bool(result.get("error") or result["problems"]))


def main() -> int:
    control = control_requested("both tables row-wise instead")
    results = run_ranks(run_rank, (control,), WORLD_SIZE, deadline_s=DEADLINE_S)
    problems = [p for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced("; ".join(problems[:2]))
    errors = [r for r in results if r.get("error")]
    if errors:
        return cannot_run(f"rank {errors[0]['rank']} while {errors[0].get('stage', 'unknown')}: {errors[0]['error']}")
    return ok(f"the delta tracker's EMBEDDING reads hold the seeded rows ({sum(r['compared'] for r in results)} rows compared)")


if __name__ == "__main__":
    run_script(main)
