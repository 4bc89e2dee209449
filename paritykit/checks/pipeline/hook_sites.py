"""Where ``register_backward_hook`` (torchrec.distributed.train_pipeline.backward_injection) hooks
a backward work, against what its docstrings say, in the caller (no ranks: the choice of tensor
does not depend on them; the pipeline check's ``dlrm/backward-hooks`` surface run shows the hooks
firing inside a pipeline):

- ``PARAM_GRAD``: the parameter at ``hook_position`` of the module's parameters (0.0 the first, 1.0
  the last, clamped; index ``min(int(position * n), n - 1)``); if it cannot fire a hook (frozen), the
  nearest one that can, the later one first on a tie; none at all is refused. The hook gets that
  parameter's gradient, once per backward, and not after its handle is removed.
- ``ACTIVATION`` with ``FirstGradTensorFinder``: the first tensor that requires grad in the module's
  output, searched depth first through tuples, lists and dict values, a (Keyed)JaggedTensor by its
  weights. The hook gets the gradient of that tensor; an output without one is refused in forward.

The reference picks the tensor from the case's own description; each candidate's gradient is made
distinct (the parameters have distinct shapes; each output tensor is scaled by its own factor in
the loss), so the gradient the hook gets names the tensor it hooked.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from paritykit.errors import ParityError, UnsupportedByTorchrec

# An output leaf: "plain" (no grad), "grad" (requires grad), "jt-grad"/"jt-plain" (a JaggedTensor
# whose weights do or do not require grad), or a container: ("tuple", ...), ("dict", ...).
Leaf = str


@dataclass(frozen=True)
class ParamGradCase:
    frozen: tuple[bool, ...]  # per parameter of the target module, in parameters() order
    position: float

    def case_id(self) -> str:
        return f"backward hook PARAM_GRAD at position {self.position:g} of params frozen={list(self.frozen)}"

    def expected(self) -> int | None:
        """The hooked parameter's index by the docstrings' rule; None when none can fire a hook."""
        n = len(self.frozen)
        start = min(int(max(0.0, min(1.0, self.position)) * n), n - 1)
        nearest = sorted(range(n), key=lambda i: (abs(i - start), i < start))
        return next((i for i in nearest if not self.frozen[i]), None)


@dataclass(frozen=True)
class ActivationCase:
    output: tuple  # the module's output structure (see Leaf)

    def case_id(self) -> str:
        return f"backward hook ACTIVATION on the first grad tensor of output {self.output!r}"

    def expected(self) -> int | None:
        """The index, in depth-first order over the leaves, of the first leaf carrying grad."""
        leaves = list(_leaves(self.output))
        return next((i for i, leaf in enumerate(leaves) if leaf in ("grad", "jt-grad")), None)


def _leaves(node: Any):
    if isinstance(node, tuple) and node and node[0] in ("tuple", "dict"):
        for child in node[1:]:
            yield from _leaves(child)
    else:
        yield node


_LEAF = st.sampled_from(("plain", "grad", "jt-grad", "jt-plain"))
_OUTPUT = st.recursive(_LEAF, lambda inner: st.tuples(st.sampled_from(("tuple", "dict")), inner, inner), max_leaves=5)


@st.composite
def hook_site_cases(draw: st.DrawFn) -> ParamGradCase | ActivationCase:
    if draw(st.booleans()):
        frozen = tuple(draw(st.lists(st.booleans(), min_size=1, max_size=6)))
        return ParamGradCase(frozen, draw(st.sampled_from((0.0, 0.2, 0.5, 0.75, 1.0, -0.5, 1.5))))
    return ActivationCase(("tuple", draw(_OUTPUT), draw(_OUTPUT)))


PINNED = (ParamGradCase((False, True, True, False, True), 0.5), ParamGradCase((True, True, False), 0.0),
          ParamGradCase((False, True, False), 0.0),
          ParamGradCase((True, False, True, False), 0.5), ParamGradCase((True, True), 1.0),
          ActivationCase(("tuple", "plain", ("dict", "jt-plain", "jt-grad"), "grad")))


class _Params(torch.nn.Module):
    """Parameter i has shape (i + 1, 2); frozen ones do not require grad."""

    def __init__(self, frozen: tuple[bool, ...]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.full((i + 1, 2), 1.0 + i), requires_grad=not f) for i, f in enumerate(frozen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((w * x).sum() for w in self.weights)


class _Outputs(torch.nn.Module):
    """Returns the case's output structure; leaf i is a tensor of ones (or a JaggedTensor's weights)
    that the loss scales by i + 1, so its gradient is i + 1 everywhere."""

    def __init__(self, output: tuple) -> None:
        super().__init__()
        self.output, self.scale = output, torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> Any:
        from torchrec.sparse.jagged_tensor import JaggedTensor

        def build(node: Any) -> Any:
            if isinstance(node, tuple) and node and node[0] in ("tuple", "dict"):
                children = [build(child) for child in node[1:]]
                return tuple(children) if node[0] == "tuple" else {f"k{i}": c for i, c in enumerate(children)}
            grad = node in ("grad", "jt-grad")
            tensor = (self.scale * x) if grad else torch.ones(2)
            if node.startswith("jt"):
                return JaggedTensor(values=torch.arange(2), lengths=torch.tensor([2]), weights=tensor)
            return tensor

        return build(self.output)


class _Wrapper(torch.nn.Module):
    def __init__(self, target: torch.nn.Module) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> Any:
        return self.target(x)


def _loss(output: Any) -> torch.Tensor:
    """Sum over the leaves of (index + 1) x leaf, depth first (the order ActivationCase.expected counts)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> None:
        if isinstance(node, JaggedTensor):
            tensors.append(node.weights())
        elif isinstance(node, torch.Tensor):
            tensors.append(node)
        elif isinstance(node, tuple):
            for child in node:
                walk(child)
        elif isinstance(node, dict):
            for child in node.values():
                walk(child)

    walk(output)
    return sum((((i + 1) * t).sum() for i, t in enumerate(tensors) if t.requires_grad), torch.zeros(()))


def run_hook_site_case(case: ParamGradCase | ActivationCase) -> dict[str, Any]:
    try:
        from torchrec.distributed.train_pipeline.backward_injection import (FirstGradTensorFinder, InjectionSite,
                                                                             InjectionTargetType, register_backward_hook)
    except ImportError as exc:  # a stack without backward injection
        raise UnsupportedByTorchrec(f"this torchrec has no backward_injection.register_backward_hook ({exc})") from None

    param = isinstance(case, ParamGradCase)
    model = _Wrapper(_Params(case.frozen) if param else _Outputs(case.output))
    site = InjectionSite("target", FirstGradTensorFinder(), InjectionTargetType.PARAM_GRAD if param else InjectionTargetType.ACTIVATION,
                         hook_position=case.position if param else 1.0)
    expected, got = case.expected(), []
    quiet = contextlib.redirect_stdout(io.StringIO())  # torchrec prints the parameter it hooks
    if param and expected is None:
        try:
            with quiet:
                register_backward_hook(site, model, got.append)
        except AssertionError:
            return {"refused": 1}
        raise ParityError(f"{case.case_id()}: no parameter can fire a hook, and register_backward_hook accepted the site")
    with quiet:
        handle = register_backward_hook(site, model, lambda grad: got.append(grad.detach().clone()))
    x = torch.ones(2)
    if expected is None:  # an output without a tensor to hook: the forward must refuse it
        try:
            model(x)
        except RuntimeError:
            return {"refused": 1}
        raise ParityError(f"{case.case_id()}: no output tensor requires grad, and the forward did not refuse the site")
    _loss(model(x)).backward()
    if param:
        want = model.target.weights[expected].grad
        what = f"parameter {expected} (shape {tuple(want.shape)})"
    else:
        want, what = torch.full((2,), float(expected + 1)), f"output leaf {expected} (gradient {expected + 1})"
    if len(got) != 1 or got[0].shape != want.shape or not torch.equal(got[0], want):
        seen = [f"shape {tuple(g.shape)} values {g.flatten().tolist()[:4]}" for g in got]
        raise ParityError(f"{case.case_id()}: the hook got {seen or 'nothing'}, the documented site is {what}")
    handle.remove()
    _loss(model(x)).backward()
    if len(got) != 1:
        raise ParityError(f"{case.case_id()}: the hook fired again after its handle was removed")
    return {"hooks": 1}
