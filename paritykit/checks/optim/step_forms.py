"""How a row-wise Adagrad checkpoint may store its step counters, and what loading one must give.

torch's optimizers keep ``state["step"]`` as loaded when it is a tensor (torch/optim/optimizer.py:
"Make sure state['step'] is not casted") and turn a Python number (older checkpoints) into a tensor
in ``__setstate__``. ``torchrec.optim.RowWiseAdagrad`` copies that rule, so the oracle is
``torch.optim.Adagrad`` loading the same state dict. Why the dtype matters: float32 counts
integers exactly only up to 2**24, so a float64 step loaded as float32 stops counting there and the
lr_decay schedule stalls.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from paritykit.errors import HarnessError, ParityError

STEP_FORMS = ("tensor", "float64", "number")


def checkpointed(state_dict: dict[str, Any], step_saved_as: str) -> dict[str, Any]:
    """A deep copy of an optimizer's state dict whose steps are stored as ``step_saved_as``."""
    if step_saved_as not in STEP_FORMS:
        raise HarnessError(f"step_saved_as {step_saved_as!r}: expected one of {STEP_FORMS}")
    saved = copy.deepcopy(state_dict)
    for entry in saved["state"].values():
        if step_saved_as == "float64":
            entry["step"] = entry["step"].to(torch.float64)
        elif step_saved_as == "number":
            entry["step"] = int(entry["step"].item())
    return saved


def _step_form(step: Any) -> tuple[str, float]:
    return (str(step.dtype) if torch.is_tensor(step) else type(step).__name__), float(step)


def expect_loaded_like_torch(optimizer: Any, saved: dict[str, Any], params: dict[str, torch.nn.Parameter],
                             kwargs: dict[str, Any], case_id: str) -> None:
    """After ``optimizer.load_state_dict(saved)``: each step as torch's Adagrad loads it (dtype and
    value), each accumulator the saved one bit for bit."""
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params.values()]
    oracle = torch.optim.Adagrad(twins, **kwargs)
    oracle.load_state_dict(copy.deepcopy(saved))
    for index, (name, param) in enumerate(params.items()):
        got, want = optimizer.state[param], oracle.state[twins[index]]
        if _step_form(got["step"]) != _step_form(want["step"]):
            raise ParityError(f"{case_id}: {name}'s step after load_state_dict is {_step_form(got['step'])}, "
                              f"torch's Adagrad loads {_step_form(want['step'])} from the same checkpoint")
        sum_saved = saved["state"][index]["sum"]
        if got["sum"].dtype != sum_saved.dtype or not torch.equal(got["sum"], sum_saved):
            raise ParityError(f"{case_id}: {name}'s accumulator after load_state_dict differs from the saved one")
