"""More of torchrec.optim on dense parameters, in the caller:

- ``SemiSyncCase``: ``SemisyncOptimizer`` (local optimizer every step, the global optimizer's
  ``global_step`` after every ``num_local_steps``-th) with a DiLoCo-style global optimizer (outer SGD
  on the pseudo-gradient ``anchor - params``), a change of the local lr, optionally resumed from its
  state dict with its param groups, against the same loop written out with torch's optimizer and
  the outer update by hand; optionally the last parameter held by the global optimizer only, which
  ``params`` and the state dict must still carry;
- ``ContractCase``: what torchrec.optim documents it refuses: its placeholder optimizers (the
  classes that only name a fused fbgemm optimizer) never step and keep their arguments,
  ``add_param_group`` is not implemented, and a ``KeyedOptimizer`` does not load a state with
  another parameter count.
- ``ZeroGradCase``: ``zero_grad(set_to_none=...)`` through each of torchrec's optimizer classes means
  what torch's does: ``True`` leaves every gradient None, ``False`` a zero tensor (which optimizers
  still step: momentum and weight decay move a parameter with a zero gradient, not one without);
  without the argument, what the class's signature declares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.checks.optim.dense_cases import _check, _grads, _params
from paritykit.errors import HarnessError, ParityError

PLACEHOLDERS = ("SGD", "LarsSGD", "LAMB", "PartialRowWiseLAMB", "Adam", "PartialRowWiseAdam", "Adagrad")


@dataclass(frozen=True)
class SemiSyncCase:
    num_local_steps: int
    outer_lr: float
    local: str  # "sgd" or "adam"
    steps: int = 7
    # Before this step: state_dict() with save_param_groups(True), a fresh optimizer, init_state(),
    # load_state_dict().
    resume_at: int | None = None
    local_lr_factor: float = 1.0  # the user's change of the local optimizer's lr before step 1
    seed: int = 0
    global_only: bool = False  # the last parameter is held by the global optimizer only

    def case_id(self) -> str:
        resume = f" resume before step {self.resume_at}" if self.resume_at is not None else ""
        change = f" local lr x{self.local_lr_factor:g} before step 1" if self.local_lr_factor != 1.0 else ""
        only = " last param global-only" if self.global_only else ""
        return (f"dense semi-sync local={self.local} every {self.num_local_steps} outer_lr={self.outer_lr}{change}{only} "
                f"steps={self.steps}{resume} seed={self.seed}")

    def local_names(self, names: list[str]) -> list[str]:
        return names[:-1] if self.global_only else names


@dataclass(frozen=True)
class ContractCase:
    seed: int = 0

    def case_id(self) -> str:
        return f"dense torchrec.optim refusals seed={self.seed}"


# What zero_grad() does without the argument, as each class's signature says: KeyedOptimizer keeps
# torch.optim.Optimizer's (True); torchrec's own wrappers declare set_to_none=False.
ZERO_GRAD_DEFAULTS = {"keyed": True, "keyed_wrapper": False, "combined": False, "warmup": False, "clipping": False}
ZERO_GRAD_WRAPPERS = tuple(ZERO_GRAD_DEFAULTS)


@dataclass(frozen=True)
class ZeroGradCase:
    wrapper: str  # one of ZERO_GRAD_WRAPPERS
    set_to_none: bool | None  # None: zero_grad() without the argument
    seed: int = 0

    def case_id(self) -> str:
        argument = "" if self.set_to_none is None else f"set_to_none={self.set_to_none}"
        return f"dense {self.wrapper}.zero_grad({argument}) seed={self.seed}"

    @property
    def clears(self) -> bool:
        """Whether the gradients must end None (else zero tensors)."""
        return ZERO_GRAD_DEFAULTS[self.wrapper] if self.set_to_none is None else self.set_to_none


class OuterSGD(torch.optim.Optimizer):
    """A global optimizer: an anchor copy of every parameter; ``global_step`` moves the anchor by
    outer_lr times the pseudo-gradient (anchor - params) and puts the parameters back on it."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["anchor"] = p.detach().clone()

    def step(self, closure: Any = None) -> None:
        raise RuntimeError("a global optimizer steps through global_step only")

    @torch.no_grad()
    def global_step(self, local_steps: torch.Tensor, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                anchor = self.state[p]["anchor"]
                anchor.sub_(group["lr"] * (anchor - p))
                p.copy_(anchor)


def _local(case: SemiSyncCase, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05) if case.local == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _semi_sync(case: SemiSyncCase, params: dict[str, torch.nn.Parameter]):
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.semi_sync import SemisyncOptimizer

    local = KeyedOptimizerWrapper({n: params[n] for n in case.local_names(list(params))}, lambda ps: _local(case, ps))
    outer = KeyedOptimizerWrapper(dict(params), lambda ps: OuterSGD(ps, case.outer_lr))
    optimizer = SemisyncOptimizer(list(params.values()), local, outer, num_local_steps=case.num_local_steps)
    optimizer.save_param_groups(True)
    return optimizer


def run_semi_sync(case: SemiSyncCase) -> dict[str, Any]:
    theirs, ours = _params(case.seed), _params(case.seed)
    optimizer = _semi_sync(case, theirs)
    _expect_params(case, optimizer, list(theirs))
    reference = _local(case, [ours[n] for n in case.local_names(list(ours))])
    anchors = {name: p.detach().clone() for name, p in ours.items()}
    for step in range(case.steps):
        if step == case.resume_at:
            saved, weights = optimizer.state_dict(), {n: p.detach().clone() for n, p in theirs.items()}
            optimizer = _semi_sync(case, theirs)
            optimizer.init_state()  # a dummy step: the weights come back from the "checkpoint" after it
            with torch.no_grad():
                for name, p in theirs.items():
                    p.copy_(weights[name])
            optimizer.load_state_dict(saved)
            _expect_params(case, optimizer, list(theirs))
        if step == 1:
            # The local optimizer's groups come first in SemisyncOptimizer.param_groups.
            for group in list(optimizer.param_groups)[: len(optimizer._optimizer.param_groups)] + list(reference.param_groups):
                group["lr"] *= case.local_lr_factor
        optimizer.zero_grad()
        for name, grad in _grads(case.seed, step, theirs).items():
            theirs[name].grad, ours[name].grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
        if (step + 1) % case.num_local_steps == 0:
            with torch.no_grad():
                for name, p in ours.items():
                    anchors[name] -= case.outer_lr * (anchors[name] - p)
                    p.copy_(anchors[name])
        _check(f"parameters after step {step}", {k: v.detach() for k, v in theirs.items()}, {k: v.detach() for k, v in ours.items()}, case.case_id())
        _expect_counters(case, optimizer, step + 1)
    return {"steps": case.steps, "global_steps": case.steps // case.num_local_steps}


def _expect_counters(case: SemiSyncCase, optimizer: Any, steps: int) -> None:
    """After ``steps`` steps (through a checkpoint too) the local step counter is ``steps`` and the global
    one counts the global steps taken, one every ``num_local_steps``-th."""
    from torchrec.optim.semi_sync import SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY

    got = {key: int(optimizer.params[key]) for key in (SEMISYNC_LOCAL_STEP_COUNTER_KEY, SEMISYNC_GLOBAL_STEP_COUNTER_KEY)}
    want = {SEMISYNC_LOCAL_STEP_COUNTER_KEY: steps, SEMISYNC_GLOBAL_STEP_COUNTER_KEY: steps // case.num_local_steps}
    if got != want:
        raise ParityError(f"{case.case_id()}: SemisyncOptimizer's step counters after {steps} steps are {got}, expected {want} "
                          f"(a global step every {case.num_local_steps} local steps)")


def _expect_params(case: SemiSyncCase, optimizer: Any, names: list[str]) -> None:
    """``params`` is both optimizers' parameters (by key) and the two step counters; the state dict
    holds every parameter's state (a global-only one keeps its anchor through a checkpoint)."""
    from torchrec.optim.semi_sync import SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY

    expected = set(names) | {SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY}
    if set(optimizer.params) != expected:
        raise ParityError(f"{case.case_id()}: SemisyncOptimizer.params has keys {sorted(optimizer.params)}, "
                          f"expected both optimizers' parameters and the step counters {sorted(expected)}")
    missing = sorted(set(names) - set(optimizer.state_dict()["state"]))
    if missing:
        raise ParityError(f"{case.case_id()}: SemisyncOptimizer.state_dict() has no state for {missing}")


def _refuses(what: str, case: ContractCase, error: type, call: Any) -> None:
    try:
        call()
    except error:
        return
    raise ParityError(f"{case.case_id()}: {what} did not raise {error.__name__}")


def run_contract(case: ContractCase) -> dict[str, Any]:
    import torchrec.optim as trec_optim
    from torchrec.optim.keyed import KeyedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.warmup import WarmupOptimizer

    params = _params(case.seed)
    present = [name for name in PLACEHOLDERS if hasattr(trec_optim, name)]
    for name in present:
        placeholder = getattr(trec_optim, name)(list(params.values()), lr=0.3, eps=1e-4)
        if placeholder._kwargs != {"lr": 0.3, "eps": 1e-4}:
            raise ParityError(f"{case.case_id()}: torchrec.optim.{name} kept {placeholder._kwargs}, not the arguments it was given")
        _refuses(f"torchrec.optim.{name}.step() (a placeholder for fbgemm's fused optimizer)", case, NotImplementedError, placeholder.step)
    keyed = KeyedOptimizerWrapper(dict(params), lambda ps: torch.optim.Adam(ps, lr=0.1))
    wrapper = WarmupOptimizer(keyed, [], lr=0.1)
    _refuses("KeyedOptimizer.add_param_group", case, NotImplementedError, lambda: keyed.add_param_group({"params": []}))
    _refuses("OptimizerWrapper.add_param_group", case, NotImplementedError, lambda: wrapper.add_param_group({"params": []}))
    keyed.init_state()
    fewer = {"state": dict(list(keyed.state_dict()["state"].items())[:-1])}
    fresh = KeyedOptimizerWrapper(dict(params), lambda ps: torch.optim.Adam(ps, lr=0.1))
    fresh.init_state()
    _refuses("KeyedOptimizer.load_state_dict of a state with fewer parameters", case, ValueError, lambda: fresh.load_state_dict(fewer))
    # KeyedOptimizer's documented invariant: every state key is one of its parameters.
    stray = torch.zeros(1)
    _refuses("KeyedOptimizer with state for a tensor that is not one of its parameters", case, ValueError,
             lambda: KeyedOptimizer(dict(params), {stray: {"step": torch.tensor(0.0)}}, [{"params": list(params.values())}]))
    return {"placeholders": len(present), "refusals": len(present) + 4}


def _zero_grad_optimizer(wrapper: str, params: dict[str, torch.nn.Parameter]) -> Any:
    from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.warmup import WarmupOptimizer

    def keyed(names: list[str]) -> KeyedOptimizer:  # torchrec's base class: torch's zero_grad
        return KeyedOptimizer({n: params[n] for n in names}, {}, [{"params": [params[n] for n in names]}])

    names = list(params)
    if wrapper == "keyed":
        return keyed(names)
    if wrapper == "keyed_wrapper":
        return KeyedOptimizerWrapper(dict(params), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    if wrapper == "combined":
        return CombinedOptimizer([("a", keyed(names[:1])), ("b", keyed(names[1:]))])
    if wrapper == "warmup":
        return WarmupOptimizer(keyed(names), [], lr=0.1)
    if wrapper == "clipping":
        return GradientClippingOptimizer(keyed(names), clipping=GradientClipping.NORM, max_gradient=1.0)
    raise HarnessError(f"zero_grad case: unknown optimizer {wrapper!r} (one of {ZERO_GRAD_WRAPPERS})")


def run_zero_grad(case: ZeroGradCase) -> dict[str, Any]:
    params = _params(case.seed)
    optimizer = _zero_grad_optimizer(case.wrapper, params)
    for name, grad in _grads(case.seed, 0, params).items():
        params[name].grad = grad
    optimizer.zero_grad() if case.set_to_none is None else optimizer.zero_grad(set_to_none=case.set_to_none)
    for name, param in params.items():
        if case.clears and param.grad is not None:
            raise ParityError(f"{case.case_id()}: {name}'s gradient is a tensor, not None")
        if not case.clears and (param.grad is None or param.grad.shape != param.shape or bool(param.grad.any())):
            got = "None" if param.grad is None else f"a tensor of shape {tuple(param.grad.shape)}, {int(param.grad.count_nonzero())} non-zero"
            raise ParityError(f"{case.case_id()}: {name}'s gradient is {got}, not zeros of shape {tuple(param.shape)}")
    return {"parameters": len(params)}
