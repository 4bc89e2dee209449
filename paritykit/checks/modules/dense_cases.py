"""A dense case: torchrec's module against its documented formula, forward and gradients.

The reference runs in float64 on copies of torchrec's parameters and inputs (promoted), so that its
own rounding is negligible next to torchrec's, and once more in float32 to measure how much rounding
the formula suffers at this point (tolerance.py); torchrec runs in the drawn dtype. One seeded
upstream gradient is pulled back through all three: the gradients of every input and every
parameter are compared (a parameter torchrec's forward does not use while the formula does, or the
reverse, is a divergence).
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.checks.modules.dense_modules import DenseSpec, build, call
from paritykit.checks.modules.dense_reference import reference
from paritykit.checks.modules.tolerance import factorization_machine_bounds, largest, noise, normwise_with_cancellation
from paritykit.engine.comparison import Bound
from paritykit.errors import ParityError
from paritykit.harness.seeding import generator

Grads = list[torch.Tensor | None]


def _check(what: str, actual: torch.Tensor | None, expected: torch.Tensor | None, bound: Bound, spec: DenseSpec) -> None:
    if actual is None or expected is None:
        if actual is not None or expected is not None:
            used = "torchrec's forward does not use it" if actual is None else "the formula does not use it"
            raise ParityError(f"{spec.kind} {what}: no gradient on one side ({used}) [{spec.case_id()}]")
        return
    if actual.shape != expected.shape or actual.dtype != spec.torch_dtype:
        raise ParityError(f"{spec.kind} {what}: torchrec gives {tuple(actual.shape)} {actual.dtype}, the formula "
                          f"{tuple(expected.shape)} {spec.torch_dtype} [{spec.case_id()}]")
    found = bound.differences(actual.detach(), expected.detach().to(actual.dtype), what)
    if found:
        raise ParityError(f"{spec.kind} {what} differs from the documented formula ({bound.describe()}): {found[0]} "
                          f"[{spec.case_id()}]")


def formula_run(spec: DenseSpec, params: dict[str, torch.Tensor], inputs: list[torch.Tensor], upstream: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, Grads]:
    """The formula in ``dtype`` on copies of torchrec's parameters and inputs: its output and the
    gradients of the inputs, then of the parameters (in named_parameters order)."""
    ref_params = {name: t.detach().to(dtype).requires_grad_() for name, t in params.items()}
    ref_inputs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    output = reference(spec, ref_params, ref_inputs)
    if output.shape != upstream.shape:  # the upstream gradient has torchrec's output shape
        raise ParityError(f"{spec.kind} output: torchrec gives {tuple(upstream.shape)}, the formula "
                          f"{tuple(output.shape)} [{spec.case_id()}]")
    grads = torch.autograd.grad(output, ref_inputs + list(ref_params.values()), upstream.to(dtype), allow_unused=True)
    return output.detach(), list(grads)


def _bounds(spec: DenseSpec, inputs: list[torch.Tensor], upstream: torch.Tensor, exact: tuple[torch.Tensor, Grads],
            rough: tuple[torch.Tensor, Grads]) -> tuple[Bound, Bound]:
    if spec.kind == "factorization_machine":
        return factorization_machine_bounds(inputs, spec.torch_dtype, float(upstream.abs().max()))
    dtype = spec.torch_dtype
    forward = normwise_with_cancellation(dtype, largest([exact[0]]), noise([rough[0]], [exact[0]], dtype), "the output")
    backward = normwise_with_cancellation(dtype, largest(exact[1]), noise(rough[1], exact[1], dtype), "every gradient")
    return forward, backward


def run_dense_case(spec: DenseSpec) -> dict[str, Any]:
    """torchrec's forward and gradients against the formula's; metrics say what was compared."""
    module, inputs = build(spec)
    inputs = [t.requires_grad_() for t in inputs]
    output = call(spec, module, inputs)
    params = dict(module.named_parameters())
    upstream = torch.randn(tuple(output.shape), generator=generator("modules upstream", spec.case_id()), dtype=torch.float64)
    exact = formula_run(spec, params, inputs, upstream, torch.float64)
    rough = formula_run(spec, params, inputs, upstream, torch.float32)
    forward_bound, grad_bound = _bounds(spec, inputs, upstream, exact, rough)
    _check("output", output, exact[0], forward_bound, spec)
    actual_grads = torch.autograd.grad(output, inputs + list(params.values()), upstream.to(output.dtype), allow_unused=True)
    names = [f"input {i} gradient" for i in range(len(inputs))] + [f"{name} gradient" for name in params]
    for name, actual, wanted in zip(names, actual_grads, exact[1]):
        _check(name, actual, wanted, grad_bound, spec)
    return {"outputs": output.numel(), "gradients": len(names), "parameters": len(params)}
