"""torchrec's python optimizers and wrappers on plain dense parameters, in the caller (no ranks):

- ``RowWiseCase``: ``torchrec.optim.RowWiseAdagrad`` with drawn hyper-parameters against torch's
  ``Adagrad`` on one-column parameters (where row-wise Adagrad is Adagrad) and against the update
  rule written out (``HandRowWiseAdagrad``) on wider ones;
- ``ScheduleCase``: ``WarmupOptimizer`` over a ``KeyedOptimizerWrapper`` with drawn stages against
  the hand-computed schedule (optim_schedule.py) driving torch's SGD, optionally resumed from its
  state dict (``init_state`` + ``load_state_dict``) into a fresh wrapper;
- ``KeyedCase``: a ``CombinedOptimizer`` of ``KeyedOptimizerWrapper``s (per-group lr changes,
  ``save_param_groups``) resumed from its state dict, against torch's optimizers never interrupted.

Gradients are drawn from the case's seed; every number is compared within the norm-wise bound.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from paritykit.checks.optim.step_forms import checkpointed, expect_loaded_like_torch
from paritykit.engine.optim_reference import HandRowWiseAdagrad
from paritykit.engine.optim_schedule import scheduled_lr
from paritykit.engine.optim_wrapping import Warmup, warmup_stages
from paritykit.engine.tolerances import normwise
from paritykit.errors import ParityError, expect
from paritykit.harness.seeding import generator

SHAPES = ((6, 1), (5, 4), (3, 8))


@dataclass(frozen=True)
class RowWiseCase:
    kwargs: tuple[tuple[str, Any], ...]
    steps: int = 4
    seed: int = 0
    # Before this step: a fresh RowWiseAdagrad loads the state_dict (torch's, through __setstate__).
    resume_at: int | None = None
    # How the checkpoint stores each step (STEP_FORMS): as saved, a float64 tensor (an optimizer
    # made under a float64 default dtype), a Python number (older checkpoints).
    step_saved_as: str = "tensor"

    def case_id(self) -> str:
        resume = f" resume before step {self.resume_at} (step saved as {self.step_saved_as})" if self.resume_at is not None else ""
        return f"dense row-wise Adagrad {dict(self.kwargs)} steps={self.steps}{resume} seed={self.seed}"


@dataclass(frozen=True)
class ScheduleCase:
    warmup: Warmup
    steps: int
    resume_at: int | None = None
    seed: int = 0
    # The warm-up wraps some parameters' optimizer inside a CombinedOptimizer beside a plain SGD on
    # the rest (a warm-up for one optimizer of several); the user saves and loads the combined one.
    in_combined: bool = False

    def case_id(self) -> str:
        resume = f" resume before step {self.resume_at}" if self.resume_at is not None else ""
        where = " inside a CombinedOptimizer" if self.in_combined else ""
        return f"dense {self.warmup.describe()}{where} steps={self.steps}{resume} seed={self.seed}"


@dataclass(frozen=True)
class KeyedCase:
    lr_factors: tuple[float, float]  # the user's lr change (Adam group, SGD group) before step 1
    resume_at: int
    steps: int = 4
    seed: int = 0

    def case_id(self) -> str:
        return f"dense keyed state round trip lr x{self.lr_factors} resume before step {self.resume_at} steps={self.steps} seed={self.seed}"


def _params(seed: int, shapes=SHAPES) -> dict[str, torch.nn.Parameter]:
    return {f"p{i}": torch.nn.Parameter(torch.randn(*shape, generator=generator("dense param", seed, i))) for i, shape in enumerate(shapes)}


def _grads(seed: int, step: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.randn(p.shape, generator=generator("dense grad", seed, step, name)) for name, p in params.items()}


def _check(what: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], case_id: str) -> int:
    bound = normwise(torch.float32)
    found = bound.differences(actual, expected, what)
    if found:
        raise ParityError(f"{case_id}: {what} differs ({bound.describe()}): {found[0]}")
    return len(expected)


def run_row_wise(case: RowWiseCase) -> dict[str, Any]:
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    theirs, ours = _params(case.seed), _params(case.seed)
    kwargs = dict(case.kwargs)
    optimizer = RowWiseAdagrad(list(theirs.values()), **kwargs)
    one_column = [p for p in ours.values() if p.shape[1] == 1]
    wider = [p for p in ours.values() if p.shape[1] > 1]
    references = [torch.optim.Adagrad(one_column, **kwargs), HandRowWiseAdagrad(wider, {}, **kwargs)]
    optimizer.share_memory()  # what a Hogwild!-style user does: the accumulators move to shared memory
    if not all(optimizer.state[p]["sum"].is_shared() for p in theirs.values()):
        raise ParityError(f"{case.case_id()}: RowWiseAdagrad.share_memory() left an accumulator unshared")
    for step in range(case.steps):
        if step == case.resume_at:
            saved = checkpointed(optimizer.state_dict(), case.step_saved_as)
            optimizer = RowWiseAdagrad(list(theirs.values()), **kwargs)
            optimizer.load_state_dict(copy.deepcopy(saved))
            expect_loaded_like_torch(optimizer, saved, theirs, kwargs, case.case_id())
        for name, grad in _grads(case.seed, step, theirs).items():
            theirs[name].grad, ours[name].grad = grad.clone(), grad.clone()
        optimizer.step()
        for reference in references:
            reference.step()
        _check(f"parameters after step {step}", {k: v.detach() for k, v in theirs.items()}, {k: v.detach() for k, v in ours.items()}, case.case_id())
    state = {f"{n}/sum": optimizer.state[p]["sum"] for n, p in theirs.items()}
    expected = {f"{n}/sum": next(r.state[p]["sum"] for r in references if p in r.state) for n, p in ours.items()}
    counted = {n: float(optimizer.state[p]["step"]) for n, p in theirs.items()}
    if any(c != case.steps for c in counted.values()):
        raise ParityError(f"{case.case_id()}: steps counted {counted}, {case.steps} were taken")
    return {"compared": case.steps * len(theirs) + _check("accumulators", state, expected, case.case_id())}


# The plain SGD's lr beside a warm-up inside a CombinedOptimizer.
UNSCHEDULED_LR = 0.05


def _warmed_names(case: ScheduleCase, params: dict[str, torch.nn.Parameter]) -> list[str]:
    names = list(params)
    return names[: len(names) // 2] if case.in_combined else names


def _schedule_wrapper(case: ScheduleCase, params: dict[str, torch.nn.Parameter]) -> tuple[Any, Any]:
    """(what the user steps, saves and loads; the WarmupOptimizer)."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.warmup import WarmupOptimizer

    warmed = {n: params[n] for n in _warmed_names(case, params)}
    inner = KeyedOptimizerWrapper(warmed, lambda ps: torch.optim.SGD(ps, lr=case.warmup.lr))
    warmup = WarmupOptimizer(inner, warmup_stages(case.warmup), lr=case.warmup.lr)
    if not case.in_combined:
        return warmup, warmup
    rest = {n: p for n, p in params.items() if n not in warmed}
    plain = KeyedOptimizerWrapper(rest, lambda ps: torch.optim.SGD(ps, lr=UNSCHEDULED_LR))
    return CombinedOptimizer([("warm", warmup), ("plain", plain)]), warmup


def run_schedule(case: ScheduleCase) -> dict[str, Any]:
    theirs, ours = _params(case.seed), _params(case.seed)
    stepped, warmup = _schedule_wrapper(case, theirs)
    warmed = _warmed_names(case, ours)
    reference = torch.optim.SGD(
        [{"params": [ours[n] for n in warmed], "lr": scheduled_lr(case.warmup, 0)},
         {"params": [p for n, p in ours.items() if n not in warmed], "lr": UNSCHEDULED_LR}])
    for step in range(case.steps):
        if step == case.resume_at:
            saved = stepped.state_dict()
            stepped, warmup = _schedule_wrapper(case, theirs)
            stepped.init_state()
            stepped.load_state_dict(saved)
        want = scheduled_lr(case.warmup, step)
        got = [group["lr"] for group in warmup.param_groups]
        if any(abs(lr - want) > 1e-12 * max(abs(want), 1.0) for lr in got):
            raise ParityError(f"{case.case_id()}: step {step} trained with lr {got}, the schedule says {want!r}")
        reference.param_groups[0]["lr"] = want
        for name, grad in _grads(case.seed, step, theirs).items():
            theirs[name].grad, ours[name].grad = grad.clone(), grad.clone()
        stepped.step()
        reference.step()
    _check("parameters after the last step", {k: v.detach() for k, v in theirs.items()}, {k: v.detach() for k, v in ours.items()}, case.case_id())
    return {"steps": case.steps, "lrs_compared": case.steps}


def _keyed_wrapper(params: dict[str, torch.nn.Parameter]):
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    first, second = dict(list(params.items())[:2]), dict(list(params.items())[2:])
    # The first optimizer without a key: its parameters keep their own names in the combined state.
    combined = CombinedOptimizer([KeyedOptimizerWrapper(first, lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.01)),
                                  ("sgd", KeyedOptimizerWrapper(second, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))])
    combined.save_param_groups(True)
    return combined


def run_keyed(case: KeyedCase) -> dict[str, Any]:
    theirs, ours = _params(case.seed), _params(case.seed)
    combined = _keyed_wrapper(theirs)
    # save_param_groups on the combined optimizer reaches each optimizer in it (a user saving one alone).
    for key, optimizer in combined.optimizers:
        expect("param_groups" in optimizer.state_dict(),
               f"{case.case_id()}: CombinedOptimizer.save_param_groups(True), yet its optimizer {key!r} saves no param_groups")
    names = list(ours)
    references = [torch.optim.Adam([ours[n] for n in names[:2]], lr=0.05, weight_decay=0.01),
                  torch.optim.SGD([ours[n] for n in names[2:]], lr=0.1, momentum=0.9)]
    for step in range(case.steps):
        if step == case.resume_at:
            saved, weights = combined.state_dict(), {n: p.detach().clone() for n, p in theirs.items()}
            combined = _keyed_wrapper(theirs)
            combined.init_state()  # a dummy step: the weights come back from the "checkpoint" after it
            with torch.no_grad():
                for n, p in theirs.items():
                    p.copy_(weights[n])
            combined.load_state_dict(saved)
        if step == 1:
            for groups, factor, reference in zip((combined.optimizers[0][1].param_groups, combined.optimizers[1][1].param_groups),
                                                 case.lr_factors, references):
                for group in list(groups) + list(reference.param_groups):
                    group["lr"] *= factor
        for name, grad in _grads(case.seed, step, theirs).items():
            theirs[name].grad, ours[name].grad = grad.clone(), grad.clone()
        combined.step()
        for reference in references:
            reference.step()
    _check("parameters after the last step", {k: v.detach() for k, v in theirs.items()}, {k: v.detach() for k, v in ours.items()}, case.case_id())
    keyed = {f"{k}/{s}": torch.as_tensor(v).float() for k, e in combined.state_dict()["state"].items() for s, v in e.items() if v is not None}
    expected = {f"{prefix}{names[i]}/{s}": torch.as_tensor(v).float() for prefix, ref, idx in (("", references[0], (0, 1)), ("sgd.", references[1], (2,)))
                for i in idx for s, v in ref.state[ours[names[i]]].items() if v is not None}
    return {"steps": case.steps, "state_compared": _check("keyed optimizer state", keyed, expected, case.case_id())}
