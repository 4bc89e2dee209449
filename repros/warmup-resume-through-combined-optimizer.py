"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue warmup-resume-through-combined-optimizer (listed for torchrec >=1.8,<1.10).

A WarmupOptimizer over a CombinedOptimizer (DMP's fused optimizer, or a GradientClippingOptimizer of
one) keeps its iteration in a copy of the combined state (CombinedOptimizer.state and .params are
properties building new dicts, which OptimizerWrapper captures once): state_dict() never carries the
iteration, and after load_state_dict the schedule restarts at iteration 0.

What to do instead: wrap each KeyedOptimizer in its own WarmupOptimizer and combine those, or save
the warm-up iteration yourself and replay it.

The script trains two nn.Linear layers for 6 steps with torch's SGD (momentum 0.9) through
torchrec's wrappers: WarmupOptimizer(CombinedOptimizer([KeyedOptimizerWrapper(layer a),
KeyedOptimizerWrapper(layer b)])), warm-up LINEAR(max_iters=4, value=0.25), lr 0.2. After step 2 it
saves the optimizer's state_dict, builds fresh wrappers over the same parameters, calls init_state()
and load_state_dict() (torchrec's resume recipe) and trains steps 3-5. Its oracle is one
uninterrupted torch.optim.SGD loop (momentum 0.9) whose lr is set by hand before each step t: 0.2 x
(0.25 + 0.75 t / 4) up to t = 4, 0.2 after. Every step's lr is compared (|a - b| <= 1e-12 x lr: a
product of Python floats either way), then the weights after it (|a - b| <= 8 units of float32
roundoff x (|b| + max|b|): the same updates on the same numbers).

    python this_script.py            the warm-up around a CombinedOptimizer
    python this_script.py --control  the warm-up around one KeyedOptimizerWrapper of both layers,
                                     whose state the warm-up shares: the iteration round-trips

    exit 0: the resumed run follows the uninterrupted schedule
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


LR = 0.2
MOMENTUM = 0.9
WARMUP = (4, 0.25)  # LINEAR: max_iters, value
STEPS = 6
RESUME_AT = 3
UNITS_OF_ROUNDOFF = 8


def hand_lr(t: int) -> float:
    max_iters, value = WARMUP
    return LR * (value + (1.0 - value) * t / max_iters) if t <= max_iters else LR


def model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, [torch.randn(5, 4) for _ in range(STEPS)]


def loss_of(model, batch) -> torch.Tensor:
    return (model(batch) ** 2).sum()


def torchrec_optimizer(model, combined: bool):
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

    def sgd(params):
        return KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM))

    if combined:
        inner = CombinedOptimizer([("a", sgd(dict(model[0].named_parameters()))), ("b", sgd(dict(model[1].named_parameters())))])
    else:
        inner = sgd(dict(model.named_parameters()))
    stage = WarmupStage(policy=WarmupPolicy.LINEAR, max_iters=WARMUP[0], value=WARMUP[1])
    return WarmupOptimizer(inner, [stage], lr=LR)


def torchrec_run(combined: bool) -> list:
    model, batches = model_and_batches()
    optimizer = torchrec_optimizer(model, combined)
    record = []
    for t, batch in enumerate(batches):
        if t == RESUME_AT:  # a checkpoint of the optimizer, reloaded into fresh wrappers
            saved = optimizer.state_dict()  # the old wrappers are dropped: nothing changes it
            optimizer = torchrec_optimizer(model, combined)
            optimizer.init_state()
            optimizer.load_state_dict(saved)
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        lr = [g["lr"] for g in optimizer.param_groups]
        optimizer.step()
        record.append((lr, [p.detach().clone() for p in model.parameters()]))
    return record


def oracle_run() -> list:
    model, batches = model_and_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    record = []
    for t, batch in enumerate(batches):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.param_groups[0]["lr"] = hand_lr(t)
        optimizer.step()
        record.append((hand_lr(t), [p.detach().clone() for p in model.parameters()]))
    return record


def first_step_that_differs(actual: list, expected: list) -> str:
    names = [n for n, _ in model_and_batches()[0].named_parameters()]
    for t, ((lrs, params), (hand, oracle_params)) in enumerate(zip(actual, expected)):
        for lr in lrs:
            if abs(lr - hand) > 1e-12 * LR:
                resumed = " (the first step after the resume)" if t == RESUME_AT else ""
                return f"step {t}{resumed}: the warm-up's lr {lr!r} vs hand-computed {hand!r} (lr of iteration 0: {hand_lr(0)!r})"
        for name, param, oracle in zip(names, params, oracle_params):
            bound = roundoff_bound(oracle, UNITS_OF_ROUNDOFF)
            bad = (param - oracle).abs() > bound
            if bool(bad.any()):
                i = tuple(int(x) for x in bad.nonzero()[0])
                return f"step {t}: {name}{list(i)} after the step {param[i].item():.8g} vs the torch SGD loop's {oracle[i].item():.8g}"
    return ""


def main() -> int:
    combined = not control_requested("run the nearest configuration torchrec computes right")
    what = "WarmupOptimizer(CombinedOptimizer)" if combined else "WarmupOptimizer(KeyedOptimizerWrapper)"
    try:
        actual = torchrec_run(combined)
    except Exception as exc:
        return verdict_of_raise(exc, f"training {what}")
    try:
        expected = oracle_run()
    except Exception as exc:
        return cannot_run(f"the oracle failed: {type(exc).__name__}: {exc}")
    difference = first_step_that_differs(actual, expected)
    if difference:
        return reproduced(f"{what} resumed from its state_dict at step {RESUME_AT}: {difference}")
    return ok(f"{what} resumed at step {RESUME_AT} follows the uninterrupted schedule: lr and weights of {len(actual)} "
              "steps match the torch SGD loop")


if __name__ == "__main__":
    run_script(main)
