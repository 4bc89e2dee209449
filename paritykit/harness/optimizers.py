"""Optimizers named once, for the sharded model (torchrec's fused TBE optimizers, set through
``apply_optimizer_in_backward``) and for the unsharded reference (the equivalent torch optimizers).

    OptimizerSpec("sgd", lr=0.1)                          # the default, for tables and dense parameters
    OptimizerSpec("adagrad", lr=0.1, eps=1e-8)
    OptimizerSpec("rowwise_adagrad", lr=0.1, eps=1e-8)    # torchrec.optim.RowWiseAdagrad

torchrec keeps a row-wise Adagrad accumulator per row *of each shard*: a column-wise shard averages
the squared gradient over its own columns only. ``BlockRowWiseAdagrad`` is the reference for that:
row-wise Adagrad applied to each column block separately (one block: the unsharded optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from paritykit.errors import HarnessError

# Names -> how to build the torch optimizer (class path, defaults paritykit passes to both sides).
_KNOWN = {
    "sgd": ("torch.optim.SGD", {}),
    "adagrad": ("torch.optim.Adagrad", {"eps": 1e-8}),
    "rowwise_adagrad": ("torchrec.optim.RowWiseAdagrad", {"eps": 1e-8}),
    "adam": ("torch.optim.Adam", {}),
}
EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer by name with its hyper-parameters (picklable, so it travels to ranks)."""

    name: str = "sgd"
    lr: float = 0.1
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.name not in _KNOWN:
            raise HarnessError(f"unknown optimizer {self.name!r}; known: {', '.join(_KNOWN)}")
        if not self.lr > 0:
            raise HarnessError(f"optimizer {self.name!r}: lr must be positive, got {self.lr!r}")

    @classmethod
    def of(cls, value: "OptimizerSpec | str | None", lr: float = 0.1) -> "OptimizerSpec":
        if value is None:
            return cls("sgd", lr)
        if isinstance(value, OptimizerSpec):
            return value
        if isinstance(value, str):
            return cls(value, lr)
        raise HarnessError(f"an optimizer is a name ({', '.join(_KNOWN)}) or an OptimizerSpec, got {value!r}")

    def torch_class(self) -> type:
        module, _, name = _KNOWN[self.name][0].rpartition(".")
        return getattr(__import__(module, fromlist=[name]), name)

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments both sides get: paritykit's defaults, then the spec's own."""
        return {**_KNOWN[self.name][1], **self.kwargs, "lr": self.lr}

    def describe(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in sorted(self.kwargs.items()))
        return f"{self.name}(lr={self.lr}{extra})"


def require_embedding_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    if spec.name not in EMBEDDING_OPTIMIZERS:
        raise HarnessError(
            f"{spec.name!r} has no fused TBE equivalent; embedding tables train with one of {EMBEDDING_OPTIMIZERS}"
        )
    return spec


def apply_in_backward(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> None:
    """Mark embedding tables for torchrec's fused optimizer (what a user does before sharding)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    apply_optimizer_in_backward(spec.torch_class(), list(params), spec.arguments())


class BlockRowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad with one accumulator per row of each column block: torchrec's semantics for a
    table cut into column-wise shards. ``blocks[param]`` lists the block widths; a parameter without
    blocks is one block (torchrec.optim.RowWiseAdagrad exactly)."""

    def __init__(self, params: list[torch.nn.Parameter], blocks: dict[int, list[int]], lr: float, eps: float = 1e-8,
                 **unused: Any) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})
        self._blocks = blocks

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                widths = self._blocks.get(id(param), [param.shape[1]])
                state = self.state[param]
                if "sum" not in state:
                    state["sum"] = torch.zeros(param.shape[0], len(widths), dtype=param.dtype, device=param.device)
                start = 0
                for block, width in enumerate(widths):
                    grad = param.grad[:, start : start + width]
                    state["sum"][:, block] += grad.pow(2).mean(dim=1)
                    std = state["sum"][:, block : block + 1].sqrt().add_(group["eps"])
                    param[:, start : start + width].addcdiv_(grad, std, value=-group["lr"])
                    start += width
