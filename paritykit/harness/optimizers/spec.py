"""``OptimizerSpec``: an optimizer by name with its hyper-parameters, the one value both sides of a
comparison are built from (picklable, so it travels to the ranks and into checkpoints).

    OptimizerSpec("sgd", lr=0.1)                                    # the default, tables and dense layers
    OptimizerSpec("rowwise_adagrad", lr=0.05, eps=1e-3, weight_decay=0.01, weight_decay_mode="counter",
                  counter_halflife=2, counter_weight_decay_mode="decouple")
    OptimizerSpec("adam", lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)   # dense layers
    OptimizerSpec("adagrad", kwargs={"eps": 1e-4})                  # the older form, still accepted

As an embedding optimizer a spec must name a fused optimizer (catalog.FUSED) with hyper-parameters
fbgemm's kernel reads; as a dense optimizer a torch optimizer (catalog.DENSE) with its own keyword
arguments (validation.py checks that in the caller).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from paritykit.errors import HarnessError
from paritykit.harness.optimizers.catalog import DENSE, FUSED, KNOWN, FusedOptimizer, import_class


@dataclass(frozen=True, init=False)
class OptimizerSpec:
    """An optimizer by name, its learning rate and its other hyper-parameters (``kwargs``)."""

    name: str = "sgd"
    lr: float = 0.1
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)

    def __init__(self, name: str = "sgd", lr: float = 0.1, kwargs: Mapping[str, Any] | None = None, **hypers: Any) -> None:
        if name not in KNOWN:
            raise HarnessError(f"unknown optimizer {name!r}; known: {', '.join(KNOWN)}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise HarnessError(f"optimizer {name!r}: lr must be positive, got {lr!r}")
        both = sorted(set(kwargs or {}) & set(hypers))
        if both:
            raise HarnessError(f"optimizer {name!r}: {both} given both in kwargs and as keyword arguments")
        merged = {**(kwargs or {}), **hypers}
        if "lr" in merged:
            raise HarnessError(f"optimizer {name!r}: give the learning rate as lr=, not inside kwargs")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "lr", float(lr))
        object.__setattr__(self, "kwargs", {key: tuple(v) if isinstance(v, list) else v for key, v in merged.items()})

    @classmethod
    def of(cls, value: "OptimizerSpec | str | None", lr: float = 0.1) -> "OptimizerSpec":
        if value is None:
            return cls("sgd", lr)
        if isinstance(value, OptimizerSpec):
            return value
        if isinstance(value, str):
            return cls(value, lr)
        raise HarnessError(f"an optimizer is a name ({', '.join(KNOWN)}) or an OptimizerSpec, got {value!r}")

    @property
    def fused(self) -> FusedOptimizer | None:
        """The fused optimizer of this name (None for a dense-only name such as "adam")."""
        return FUSED.get(self.name)

    def hyper(self, key: str) -> Any:
        """A fused hyper-parameter's value: the spec's own, else the catalog's default."""
        if key in self.kwargs:
            return self.kwargs[key]
        hyper = self.fused.hyper(key) if self.fused else None
        if hyper is None:
            raise HarnessError(f"optimizer {self.name!r} has no hyper-parameter {key!r}")
        return hyper.default

    def fused_hypers(self) -> dict[str, Any]:
        """Every hyper-parameter of the fused optimizer, defaults filled in, plus the learning rate."""
        return {"lr": self.lr, **{h.name: self.hyper(h.name) for h in self.fused.hypers}} if self.fused else {}

    def torch_class(self) -> type:
        """The dense optimizer's torch class (a fused name: the class given to apply_optimizer_in_backward)."""
        if self.name in DENSE:
            return import_class(DENSE[self.name][0])
        return import_class(FUSED[self.name].torchrec_class)

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of the dense optimizer: paritykit's defaults, then the spec's own."""
        defaults = DENSE[self.name][1] if self.name in DENSE else {}
        return {**defaults, **self.kwargs, "lr": self.lr}

    def describe(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in sorted(self.kwargs.items()))
        return f"{self.name}(lr={self.lr:g}{extra})"

    def __repr__(self) -> str:
        return f"OptimizerSpec({self.describe()})"
