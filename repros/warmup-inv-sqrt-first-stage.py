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

import argparse
import math
import sys
import traceback

import torch

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


def torchrec_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "torchrec" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--control", action="store_true", help="run the nearest configuration torchrec computes right")
    control = parser.parse_args().control
    stages = stages_of(control)
    try:
        actual = torchrec_run(stages)
    except Exception as exc:
        where = torchrec_frame(exc)
        if not where:
            print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            return 2
        print(f"REPRODUCED: torchrec raised {type(exc).__name__}: {exc} building WarmupOptimizer with stages "
              f"{stages}, in {where}")
        return 1
    try:
        expected = oracle_run(stages, actual[0][0])
    except Exception as exc:
        print(f"CANNOT RUN: the oracle failed: {type(exc).__name__}: {exc}")
        return 2
    if not (math.isfinite(actual[0][0]) and actual[0][0] > 0):
        print(f"REPRODUCED: step 0: WarmupOptimizer's lr is {actual[0][0]!r} (stages {stages})")
        return 1
    for t, ((lr, weight), (hand, oracle_weight)) in enumerate(zip(actual, expected)):
        if abs(lr - hand) > 1e-12 * LR:
            print(f"REPRODUCED: step {t}: WarmupOptimizer's lr {lr!r} vs hand-computed {hand!r} (stages {stages})")
            return 1
        bound = UNITS_OF_ROUNDOFF * torch.finfo(torch.float32).eps / 2 * (oracle_weight.abs() + oracle_weight.abs().max())
        bad = (weight - oracle_weight).abs() > bound
        if bool(bad.any()):
            index = [int(i) for i in bad.nonzero()[0]]
            print(f"REPRODUCED: step {t}: weight{index} after the step {weight[tuple(index)].item():.8g} vs the torch SGD "
                  f"loop's {oracle_weight[tuple(index)].item():.8g}")
            return 1
    print(f"OK: the learning rate and weights of {len(actual)} steps match the hand-computed schedule (stages {stages})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
