"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue semi-sync-local-param-groups-not-restored (listed for torchrec >=1.8,<1.10).

SemisyncOptimizer with save_param_groups(True) saves the local and the global optimizer's param
groups, but KeyedOptimizer.load_state_dict matches groups by the sorted keys of their parameters,
which the two optimizers share: only the global group is loaded and a changed local learning rate
silently returns to its initial value.

What to do instead: after load_state_dict, set the local optimizer's hyper-parameters again from
the checkpoint's param groups (the first len(local param_groups) of them).

The script trains two parameters with synthetic seeded gradients for 7 steps through torchrec's
SemisyncOptimizer: local optimizer KeyedOptimizerWrapper(torch Adam, lr 0.05), global optimizer a
KeyedOptimizerWrapper of a small outer SGD (every 3 local steps the anchor moves by 0.7 x (params -
anchor) and the parameters are put back on it), save_param_groups(True). Before step 1 the user
halves the local lr. Before step 4 it saves the state_dict, builds a fresh SemisyncOptimizer, calls
init_state() (a dummy step; the weights are put back after it, as a checkpoint would) and
load_state_dict(). Its oracle is an uninterrupted plain loop: torch's Adam with the lr halved
before step 1, and the outer step written out by hand. Per step it compares the local lr (exactly:
a float copied around) and then the parameters (|a - b| <= 8 units of float32 roundoff x (|b| +
max|b|): the same operations on the same numbers).

    python this_script.py            the local lr halved before step 1, resumed before step 4
    python this_script.py --control  the local lr left alone, resumed before step 4 (Adam's state,
                                     the step counters and the outer anchors still round-trip)

    exit 0: the resumed run matches the uninterrupted one
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


LOCAL_LR = 0.05
OUTER_LR = 0.7
NUM_LOCAL_STEPS = 3
STEPS = 7
RESUME_AT = 4
CHANGE_AT = 1
UNITS_OF_ROUNDOFF = 8


class OuterSGD(torch.optim.Optimizer):
    """The global optimizer: anchor += lr * (params - anchor), then params = anchor."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["anchor"] = p.detach().clone()

    def step(self, closure=None) -> None:
        raise RuntimeError("a global optimizer steps through global_step only")

    @torch.no_grad()
    def global_step(self, local_steps, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                anchor = self.state[p]["anchor"]
                anchor.sub_(group["lr"] * (anchor - p))
                p.copy_(anchor)


def fresh_params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.nn.Parameter(torch.randn(3, 4, generator=g)), "b": torch.nn.Parameter(torch.randn(3, generator=g))}


def gradients(step: int, params: dict) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(p.shape, generator=g) for name, p in params.items()}


def semi_sync(params: dict):
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.semi_sync import SemisyncOptimizer

    local = KeyedOptimizerWrapper(dict(params), lambda ps: torch.optim.Adam(ps, lr=LOCAL_LR))
    outer = KeyedOptimizerWrapper(dict(params), lambda ps: OuterSGD(ps, OUTER_LR))
    optimizer = SemisyncOptimizer(list(params.values()), local, outer, num_local_steps=NUM_LOCAL_STEPS)
    optimizer.save_param_groups(True)
    return optimizer


def torchrec_run(lr_factor: float) -> list:
    params = fresh_params()
    optimizer = semi_sync(params)
    record = []
    for step in range(STEPS):
        if step == RESUME_AT:
            saved, weights = optimizer.state_dict(), {n: p.detach().clone() for n, p in params.items()}
            optimizer = semi_sync(params)
            optimizer.init_state()
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name])
            optimizer.load_state_dict(saved)
        if step == CHANGE_AT:
            for group in optimizer._optimizer.param_groups:
                group["lr"] *= lr_factor
        optimizer.zero_grad()
        for name, grad in gradients(step, params).items():
            params[name].grad = grad
        local_lr = optimizer._optimizer.param_groups[0]["lr"]
        optimizer.step()
        record.append((local_lr, {n: p.detach().clone() for n, p in params.items()}))
    return record


def oracle_run(lr_factor: float) -> list:
    params = fresh_params()
    adam = torch.optim.Adam(list(params.values()), lr=LOCAL_LR)
    anchors = {n: p.detach().clone() for n, p in params.items()}
    record = []
    for step in range(STEPS):
        if step == CHANGE_AT:
            adam.param_groups[0]["lr"] *= lr_factor
        for name, grad in gradients(step, params).items():
            params[name].grad = grad
        adam.step()
        if (step + 1) % NUM_LOCAL_STEPS == 0:
            with torch.no_grad():
                for name, p in params.items():
                    anchors[name] -= OUTER_LR * (anchors[name] - p)
                    p.copy_(anchors[name])
        record.append((adam.param_groups[0]["lr"], {n: p.detach().clone() for n, p in params.items()}))
    return record


def first_step_that_differs(actual: list, expected: list) -> str:
    for step, ((lr, params), (oracle_lr, oracle_params)) in enumerate(zip(actual, expected)):
        resumed = " (after the resume)" if step >= RESUME_AT else ""
        if lr != oracle_lr:
            return f"step {step}{resumed}: the local optimizer's lr {lr!r} vs {oracle_lr!r} (set before step {CHANGE_AT})"
        for name, oracle in oracle_params.items():
            bound = roundoff_bound(oracle, UNITS_OF_ROUNDOFF)
            bad = (params[name] - oracle).abs() > bound
            if bool(bad.any()):
                i = tuple(int(x) for x in bad.nonzero()[0])
                return f"step {step}{resumed}: {name}{list(i)} {params[name][i].item():.8g} vs the plain loop's {oracle[i].item():.8g}"
    return ""


def main() -> int:
    lr_factor = 1.0 if control_requested("run the nearest configuration torchrec computes right") else 0.5
    try:
        actual = torchrec_run(lr_factor)
    except Exception as exc:
        return verdict_of_raise(exc, "training SemisyncOptimizer")
    try:
        expected = oracle_run(lr_factor)
    except Exception as exc:
        return cannot_run(f"the oracle failed: {type(exc).__name__}: {exc}")
    difference = first_step_that_differs(actual, expected)
    if difference:
        return reproduced(f"SemisyncOptimizer resumed before step {RESUME_AT} with save_param_groups(True): {difference}")
    return ok(f"SemisyncOptimizer (local lr x{lr_factor:g} before step {CHANGE_AT}) resumed before step {RESUME_AT} "
              f"matches the uninterrupted Adam + outer SGD loop over {STEPS} steps")


if __name__ == "__main__":
    run_script(main)
