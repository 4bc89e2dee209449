"""Known torchrec issue dmp-load-state-dict-not-strict (listed for torchrec >=1.8,<1.10).

DistributedModelParallel.load_state_dict with its default strict=True does not raise on a missing
key outside the sharded modules (a dense parameter) nor on an unexpected key, where the unsharded
module raises: it returns them (the missing key under a name without its module prefix), so a
checkpoint that lost its dense layers loads silently. Workaround: check the returned missing_keys
and unexpected_keys yourself.

The script starts 2 ranks (torch.multiprocessing "spawn", gloo on CPU, process-group timeout 30 s),
builds a model with an EmbeddingBagCollection of t0 (8 x 4, f0) and t1 (8 x 4, f1) (seeded
torch.randn, SUM pooling, fused SGD) under a dense layer (torch.nn.Linear(4, 1)), shards it with
DistributedModelParallel (t0 table-wise on rank 0, t1 table-wise on rank 1), takes its state_dict
and loads it back with the default (strict) after leaving out "dense.weight", then after adding
"unexpected.weight". The oracle is torch's own nn.Module.load_state_dict on the unsharded model with
the same two state dicts: it raises RuntimeError ("Missing key(s)", "Unexpected key(s)"); the
sharded model must raise too. No tolerance: what is compared is whether an error is raised.
The parent waits at most 120 s and ends any rank still running.

    python this_script.py            a dense key missing / an unexpected key: exit 1 (REPRODUCED)
                                     when DistributedModelParallel.load_state_dict does not raise
    python this_script.py --control  a table's key missing (the sharded EBC's own load hook checks
                                     it): DistributedModelParallel raises as the unsharded model does:
                                     exit 0 (OK)
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
DEADLINE_S, COLLECTIVE_TIMEOUT_S = 120, 30  # the parent ends every rank after 120 s; a collective gives up after 30 s
TABLES = {"t0": (8, "f0"), "t1": (8, "f1")}  # name: (rows, feature)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=[f])
                                                  for n, (r, f) in TABLES.items()])
        apply_optimizer_in_backward(torch.optim.SGD, list(self.ebc.parameters()), {"lr": 0.1})
        self.dense = torch.nn.Linear(DIM, 1)

    def forward(self, features):
        return self.dense(self.ebc(features).values())


def spoiled(state: dict, control: bool) -> dict:
    """The state dicts to load: without a dense key and with an unexpected one (control: without a table's key)."""
    if control:
        return {"missing ebc.embedding_bags.t1.weight": {k: v for k, v in state.items() if k != "ebc.embedding_bags.t1.weight"}}
    return {"missing dense.weight": {k: v for k, v in state.items() if k != "dense.weight"},
            "unexpected unexpected.weight": {**state, "unexpected.weight": torch.zeros(1)}}


def outcome(module, state: dict) -> str:
    try:
        returned = module.load_state_dict(state)
    except RuntimeError as exc:
        return "raised RuntimeError: " + str(exc).strip().splitlines()[-1].strip()[:120]
    return f"loaded, returned {returned}"


def compare(rank: int, control: bool, result: dict) -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    unsharded, model = Model(), Model()
    plan = construct_module_sharding_plan(model.ebc, {"t0": table_wise(rank=0), "t1": table_wise(rank=1)},
                                          local_size=WORLD_SIZE, world_size=WORLD_SIZE, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   plan=ShardingPlan({"ebc": plan}), sharders=get_default_sharders())
    result["stage"] = "loading the spoiled state dicts"
    expected = {name: outcome(unsharded, state) for name, state in spoiled(dict(unsharded.state_dict()), control).items()}
    for name, state in spoiled(dict(dmp.state_dict()), control).items():
        result["compared"] += 1
        found = outcome(dmp, dict(state))
        if found.startswith("raised") != expected[name].startswith("raised"):
            result["problems"].append(f"rank {rank}, {name}: DistributedModelParallel.load_state_dict {found}; "
                                      f"the unsharded module {expected[name]}")


def run_rank(rank: int, scratch: str, control: bool) -> None:
    result = {"rank": rank, "problems": [], "compared": 0, "stage": "setting up"}
    try:
        start_process_group(rank, WORLD_SIZE, scratch, timeout_s=COLLECTIVE_TIMEOUT_S)
        result["stage"] = "sharding the model"
        compare(rank, control, result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc).strip()[:400]} ({traceback.extract_tb(exc.__traceback__)[-1].filename})"
    finish_rank(scratch, result, failed=bool(result.get("error")))


def main() -> int:
    control = control_requested("a table's key missing instead")
    results = run_ranks(run_rank, (control,), WORLD_SIZE, deadline_s=DEADLINE_S)
    problems = [p for r in results for p in r.get("problems", [])]
    if problems:
        return reproduced("; ".join(problems[:2]))
    errors = [r for r in results if r.get("error")]
    if errors:
        return cannot_run(f"rank {errors[0]['rank']} while {errors[0].get('stage', 'unknown')}: {errors[0]['error']}")
    return ok(f"DistributedModelParallel.load_state_dict raises where the unsharded module does "
              f"({sum(r['compared'] for r in results)} loads compared)")


if __name__ == "__main__":
    run_script(main)
