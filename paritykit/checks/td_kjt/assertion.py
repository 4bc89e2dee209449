"""The public td-kjt assertion: a module fed a batch as a TensorDict and as a KJT gives the same
outputs and the same parameter gradients."""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Any, Iterator

import torch
from torch import nn

from paritykit.compare import assert_close
from paritykit.convert import kjt_to_td, td_to_kjt
from paritykit.errors import Divergence, HarnessError, ParityError
from paritykit.strategies import SparseBatch

ROUTES = ("torchrec", "paritykit")


def assert_td_kjt_parity(
    module: nn.Module,
    batch: Any,
    *,
    form: str = "from_jagged_offsets",
    route: str = "paritykit",
    exact: bool = True,
    msg: str | None = None,
) -> dict[str, Any]:
    """Feed copies of ``module`` the KJT form and the TensorDict form of ``batch``; compare outputs
    and the gradients of every parameter. Raises ParityError naming the first difference.

    ``batch`` is a SparseBatch (both forms built from its rows, independently of paritykit.convert,
    on the device of the module's parameters),
    a KeyedJaggedTensor (its TensorDict form from kjt_to_td) or a TensorDict (its KJT from td_to_kjt).
    ``module`` is left untouched. Returns metrics (output and gradient element counts).
    """
    if route not in ROUTES:
        raise HarnessError(f"route must be one of {ROUTES}, got {route!r}")
    kjt, td = _both_forms(batch, form, _device_of(module))
    reference, candidate = copy.deepcopy(module), copy.deepcopy(module)
    expected = reference(kjt)
    label = msg or f"{type(module).__name__} fed a TensorDict via {route} vs a KJT"
    try:
        actual = candidate(td if route == "torchrec" else td_to_kjt(td))
    except (ParityError, HarnessError):
        raise
    except Exception as exc:
        # The KJT form ran, so the TensorDict form raising is a difference, not a harness problem.
        raise ParityError(f"{label}: outputs: the KJT form ran but the TensorDict form raised "
                          f"{type(exc).__name__}: {exc}") from exc
    with _located("forward", "output"):
        assert_close(actual, expected, exact=exact, msg=f"{label}: outputs")
    scalar_loss(expected).backward()
    scalar_loss(actual).backward()
    grads_expected = _gradients(reference)
    grads_actual = _gradients(candidate)
    if not grads_expected:
        raise HarnessError(f"{type(module).__name__}: no parameter received a gradient from the KJT form")
    with _located("backward", "parameter gradient"):
        assert_close(grads_actual, grads_expected, exact=exact, msg=f"{label}: weight gradients")
    return {"output_elements": count_output_elements(expected), "gradient_elements": sum(g.numel() for g in grads_expected.values())}


@contextlib.contextmanager
def _located(stage: str, what: str) -> Iterator[None]:
    """A difference found here carries its first divergence: the TensorDict's path against the KJT's."""
    try:
        yield
    except ParityError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip().startswith("[")]
        index = re.search(r"first at .*?(\[[-\d, ]*\]):", lines[0]) if lines else None
        exc.divergence = Divergence(stage, what, "TensorDict vs KJT", 0, element=index.group(1) if index else "",
                                    detail=lines[0] if lines else str(exc).splitlines()[0])
        raise


def _device_of(module: nn.Module) -> torch.device:
    # A SparseBatch is built where the module's parameters live, so the same call serves CPU and CUDA.
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _both_forms(batch: Any, form: str, device: torch.device):
    from tensordict import TensorDictBase
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if isinstance(batch, SparseBatch):
        return batch.to_kjt(device, lengths_dtype=batch.kjt_lengths_dtype(form)), batch.to_td(form, device)
    if isinstance(batch, KeyedJaggedTensor):
        return batch, kjt_to_td(batch)
    if isinstance(batch, TensorDictBase):
        return td_to_kjt(batch), batch
    raise HarnessError(f"batch must be a SparseBatch, KeyedJaggedTensor or TensorDict, got {type(batch).__name__}")


def scalar_loss(output: Any) -> torch.Tensor:
    """A scalar that weighs every output element differently, so a moved value changes a gradient."""
    tensors = _output_tensors(output)
    total = torch.zeros((), dtype=torch.float32)
    for tensor in tensors:
        flat = tensor.reshape(-1)
        total = total + (flat * torch.arange(1, flat.numel() + 1, dtype=flat.dtype, device=flat.device)).sum().cpu()
    return total


def _output_tensors(output: Any) -> list[torch.Tensor]:
    if hasattr(output, "wait") and not isinstance(output, torch.Tensor):
        output = output.wait()
    if isinstance(output, dict):  # EC: feature -> JaggedTensor
        return [output[key].values() for key in output]
    return [output.values()]  # EBC: KeyedTensor


def _gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}


def count_output_elements(output: Any) -> int:
    return sum(t.numel() for t in _output_tensors(output))
