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

import argparse
import sys
import traceback

import torch

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


def torchrec_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "torchrec" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def first_difference(actual: list, expected: list) -> str:
    for step, ((lr, params), (oracle_lr, oracle_params)) in enumerate(zip(actual, expected)):
        resumed = " (after the resume)" if step >= RESUME_AT else ""
        if lr != oracle_lr:
            return f"step {step}{resumed}: the local optimizer's lr {lr!r} vs {oracle_lr!r} (set before step {CHANGE_AT})"
        for name, oracle in oracle_params.items():
            bound = UNITS_OF_ROUNDOFF * torch.finfo(torch.float32).eps / 2 * (oracle.abs() + oracle.abs().max())
            bad = (params[name] - oracle).abs() > bound
            if bool(bad.any()):
                i = tuple(int(x) for x in bad.nonzero()[0])
                return f"step {step}{resumed}: {name}{list(i)} {params[name][i].item():.8g} vs the plain loop's {oracle[i].item():.8g}"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--control", action="store_true", help="run the nearest configuration torchrec computes right")
    lr_factor = 1.0 if parser.parse_args().control else 0.5
    try:
        actual = torchrec_run(lr_factor)
    except Exception as exc:
        where = torchrec_frame(exc)
        if not where:
            print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            return 2
        print(f"REPRODUCED: torchrec raised {type(exc).__name__}: {exc} training SemisyncOptimizer, in {where}")
        return 1
    try:
        expected = oracle_run(lr_factor)
    except Exception as exc:
        print(f"CANNOT RUN: the oracle failed: {type(exc).__name__}: {exc}")
        return 2
    difference = first_difference(actual, expected)
    if difference:
        print(f"REPRODUCED: SemisyncOptimizer resumed before step {RESUME_AT} with save_param_groups(True): {difference}")
        return 1
    print(f"OK: SemisyncOptimizer (local lr x{lr_factor:g} before step {CHANGE_AT}) resumed before step {RESUME_AT} "
          f"matches the uninterrupted Adam + outer SGD loop over {STEPS} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
