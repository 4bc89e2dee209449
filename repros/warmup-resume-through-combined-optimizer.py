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

import argparse
import sys
import traceback

import torch

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


def torchrec_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "torchrec" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def first_difference(actual: list, expected: list) -> str:
    names = [n for n, _ in model_and_batches()[0].named_parameters()]
    for t, ((lrs, params), (hand, oracle_params)) in enumerate(zip(actual, expected)):
        for lr in lrs:
            if abs(lr - hand) > 1e-12 * LR:
                resumed = " (the first step after the resume)" if t == RESUME_AT else ""
                return f"step {t}{resumed}: the warm-up's lr {lr!r} vs hand-computed {hand!r} (lr of iteration 0: {hand_lr(0)!r})"
        for name, param, oracle in zip(names, params, oracle_params):
            bound = UNITS_OF_ROUNDOFF * torch.finfo(torch.float32).eps / 2 * (oracle.abs() + oracle.abs().max())
            bad = (param - oracle).abs() > bound
            if bool(bad.any()):
                i = tuple(int(x) for x in bad.nonzero()[0])
                return f"step {t}: {name}{list(i)} after the step {param[i].item():.8g} vs the torch SGD loop's {oracle[i].item():.8g}"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--control", action="store_true", help="run the nearest configuration torchrec computes right")
    combined = not parser.parse_args().control
    what = "WarmupOptimizer(CombinedOptimizer)" if combined else "WarmupOptimizer(KeyedOptimizerWrapper)"
    try:
        actual = torchrec_run(combined)
    except Exception as exc:
        where = torchrec_frame(exc)
        if not where:
            print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            return 2
        print(f"REPRODUCED: torchrec raised {type(exc).__name__}: {exc} training {what}, in {where}")
        return 1
    try:
        expected = oracle_run()
    except Exception as exc:
        print(f"CANNOT RUN: the oracle failed: {type(exc).__name__}: {exc}")
        return 2
    difference = first_difference(actual, expected)
    if difference:
        print(f"REPRODUCED: {what} resumed from its state_dict at step {RESUME_AT}: {difference}")
        return 1
    print(f"OK: {what} resumed at step {RESUME_AT} follows the uninterrupted schedule: lr and weights of {len(actual)} "
          "steps match the torch SGD loop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
