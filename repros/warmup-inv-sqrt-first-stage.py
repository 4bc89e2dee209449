"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue warmup-inv-sqrt-first-stage (listed for torchrec >=1.8,<1.10).

A WarmupOptimizer whose first stage is WarmupPolicy.INVSQRT divides by sqrt(0) for iteration 0
while it is built (ZeroDivisionError in _get_multiplier).

What to do instead: start the schedule with another policy (e.g. a LINEAR or CONSTANT stage of one
or more iterations) and put the INVSQRT stage after it.

The script trains a small nn.Linear for 6 steps with torchrec's WarmupOptimizer over a
KeyedOptimizerWrapper of torch's SGD (lr 0.2). Its oracle is a plain torch.optim.SGD loop whose
learning rate is set by hand before each step from what the stages mean: step t belongs to the first
stage with max_iters >= t and trains with lr * m(t), where LINEAR gives value + (1 - value) * t /
max_iters and INVSQRT 1 / sqrt(t) (after the last stage m = 1). The learning rate of every step is
compared (|a - b| <= 1e-12 * lr: both are a product of two Python floats), then the weights after
the step (|a - b| <= 8 units of float32 roundoff x (|b| + max|b|): the same SGD update on the same
numbers, with a learning rate that may differ in its last bit).

    python this_script.py            stages INVSQRT(max_iters=4): torchrec raises while the
                                     optimizer is built. 1/sqrt(0) is undefined, so the oracle only
                                     asks for a finite positive lr at step 0 and trains that step with
                                     torchrec's; steps 1-5 follow the hand computation
    python this_script.py --control  stages LINEAR(max_iters=1, value=0.5), INVSQRT(max_iters=4):
                                     the same policy after a first stage, which torchrec computes right

    exit 0: torchrec's schedule matches the hand computation
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

import math

LR = 0.2
STEPS = 6
UNITS_OF_ROUNDOFF = 8


def stages_of(control: bool) -> list:
    """(policy, max_iters, value) per stage."""
    return [("linear", 1, 0.5), ("inv_sqrt", 4, 1.0)] if control else [("inv_sqrt", 4, 1.0)]


def hand_lr(stages: list, t: int) -> float:
    """The oracle's lr of step t; None where the policy does not define one (INVSQRT at t = 0)."""
    for policy, max_iters, value in stages:
        if t <= max_iters:
            if policy == "inv_sqrt":
                return LR / math.sqrt(t) if t > 0 else None
            return LR * (value + (1.0 - value) * t / max_iters)
    return LR


def model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    batches = [torch.randn(5, 4) for _ in range(STEPS)]
    return model, batches


def loss_of(model, batch) -> torch.Tensor:
    return (model(batch) ** 2).sum()


def torchrec_run(stages: list) -> list:
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

    model, batches = model_and_batches()
    keyed = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=LR))
    torchrec_stages = [WarmupStage(policy=WarmupPolicy(p), max_iters=m, value=v) for p, m, v in stages]
    optimizer = WarmupOptimizer(keyed, torchrec_stages, lr=LR)
    record = []
    for batch in batches:
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        lr = [g["lr"] for g in optimizer.param_groups][0]
        optimizer.step()
        record.append((lr, model.weight.detach().clone()))
    return record


def oracle_run(stages: list, torchrec_first_lr: float) -> list:
    """Where the policy leaves step 0 undefined the oracle takes torchrec's lr for it (checked usable)."""
    model, batches = model_and_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    record = []
    for t, batch in enumerate(batches):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        lr = hand_lr(stages, t)
        optimizer.param_groups[0]["lr"] = torchrec_first_lr if lr is None else lr
        optimizer.step()
        record.append((optimizer.param_groups[0]["lr"], model.weight.detach().clone()))
    return record


def main() -> int:
    control = control_requested("run the nearest configuration torchrec computes right")
    stages = stages_of(control)
    try:
        actual = torchrec_run(stages)
    except Exception as exc:
        return verdict_of_raise(exc, f"building WarmupOptimizer with stages {stages}")
    try:
        expected = oracle_run(stages, actual[0][0])
    except Exception as exc:
        return cannot_run(f"the oracle failed: {type(exc).__name__}: {exc}")
    if not (math.isfinite(actual[0][0]) and actual[0][0] > 0):
        return reproduced(f"step 0: WarmupOptimizer's lr is {actual[0][0]!r} (stages {stages})")
    for t, ((lr, weight), (hand, oracle_weight)) in enumerate(zip(actual, expected)):
        if abs(lr - hand) > 1e-12 * LR:
            return reproduced(f"step {t}: WarmupOptimizer's lr {lr!r} vs hand-computed {hand!r} (stages {stages})")
        difference = first_difference(weight, oracle_weight, roundoff_bound(oracle_weight, UNITS_OF_ROUNDOFF),
                                      oracle="the torch SGD loop")
        if difference:
            return reproduced(f"step {t}: the weight after the step: {difference}")
    return ok(f"the learning rate and weights of {len(actual)} steps match the hand-computed schedule (stages {stages})")


if __name__ == "__main__":
    run_script(main)
