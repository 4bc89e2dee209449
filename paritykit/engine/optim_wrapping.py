"""torchrec's optimizer wrappers as a user stacks them over a sharded model, named once (picklable).

    OptimizerWrapping(
        dense=(DenseGroup("matrices", "rowwise_adagrad", selects="matrices"), DenseGroup("vectors", "adam", selects="vectors")),
        clipping=Clipping("norm", max_gradient=0.05, norm_type=2.0, across_ranks=True),
        warmup=Warmup((WarmupStageSpec("linear", max_iters=2, value=0.25),), lr=0.1),
        resume_at=2,
    )

On a rank, ``wrap_optimizers`` builds what users write: ``KeyedOptimizerWrapper`` per dense group,
``CombinedOptimizer([("fused", dmp.fused_optimizer), ("<group>", ...), ...])``, then
``GradientClippingOptimizer`` and ``WarmupOptimizer`` around it (warm-up outermost). The unsharded
oracle (optim_reference.py) reads the same specs and builds torch's own optimizers instead.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from paritykit.errors import HarnessError

# A dense group's optimizer: (torch class path, the defaults paritykit passes to both sides).
DENSE_CLASSES = {
    "sgd": "torch.optim.SGD",
    "adagrad": "torch.optim.Adagrad",
    "adam": "torch.optim.Adam",
    "rowwise_adagrad": "torchrec.optim.rowwise_adagrad.RowWiseAdagrad",
}
SELECTIONS = ("all", "matrices", "vectors", "tables")
POLICIES = ("linear", "constant", "poly", "step", "inv_sqrt", "cosine_annealing_warm_restarts", "interpolate", "none")


@dataclass(frozen=True)
class DenseGroup:
    """One dense optimizer over the parameters no fused optimizer trains: ``selects`` "all",
    "matrices" (2-D: tables, linear weights), "vectors" (every other: biases, empty placeholders) or
    "tables" (embedding tables only: the dense layers are then trained by nobody)."""

    name: str
    optimizer: str = "sgd"
    lr: float = 0.1
    kwargs: tuple[tuple[str, Any], ...] = ()
    selects: str = "all"

    def __post_init__(self) -> None:
        if self.optimizer not in DENSE_CLASSES:
            raise HarnessError(f"dense group {self.name!r}: unknown optimizer {self.optimizer!r}; known: {', '.join(DENSE_CLASSES)}")
        if self.selects not in SELECTIONS:
            raise HarnessError(f"dense group {self.name!r}: selects must be one of {SELECTIONS}, got {self.selects!r}")

    def takes(self, name: str, param: torch.Tensor) -> bool:
        if self.selects == "tables":
            return ".embedding_bags." in f".{name}"
        return self.selects == "all" or (param.dim() == 2) == (self.selects == "matrices")

    def arguments(self) -> dict[str, Any]:
        return {**dict(self.kwargs), "lr": self.lr}

    def torch_class(self) -> type:
        module, _, name = DENSE_CLASSES[self.optimizer].rpartition(".")
        return getattr(__import__(module, fromlist=[name]), name)

    def describe(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.kwargs)
        return f"{self.name}:{self.optimizer}(lr={self.lr}{extra}) on {self.selects}"


@dataclass(frozen=True)
class Clipping:
    """GradientClippingOptimizer's arguments. ``across_ranks``: ``enable_global_grad_clip`` with every
    model-parallel dense-kernel table's local shard mapped to the world's process group."""

    mode: str = "norm"  # "norm", "value", or "none" (no clipping; torchrec only tracks the norm)
    max_gradient: float = 0.1
    norm_type: float = 2.0  # math.inf for the infinity norm
    across_ranks: bool = False

    def describe(self) -> str:
        norm = "inf" if math.isinf(self.norm_type) else f"{self.norm_type:g}"
        scope = " across ranks" if self.across_ranks else ""
        if self.mode == "none":
            return f"track the gradient norm (p={norm}{scope})"
        return f"clip {self.mode} {self.max_gradient:g}" + (f" (p={norm}{scope})" if self.mode == "norm" else "")


@dataclass(frozen=True)
class WarmupStageSpec:
    """One torchrec ``WarmupStage`` by policy name (``WarmupPolicy(value)``)."""

    policy: str
    max_iters: int
    value: float = 1.0
    lr_scale: float = 1.0
    decay_iters: int = -1
    sgdr_period: int = 1
    start_interpolating_iters: int | None = None
    end_value: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise HarnessError(f"warm-up policy {self.policy!r} unknown; known: {', '.join(POLICIES)}")

    def describe(self) -> str:
        return f"{self.policy}<={self.max_iters}(v={self.value:g})"


@dataclass(frozen=True)
class Warmup:
    stages: tuple[WarmupStageSpec, ...]
    lr: float = 0.1

    def describe(self) -> str:
        return f"warmup lr={self.lr:g} [" + ", ".join(s.describe() for s in self.stages) + "]"


@dataclass(frozen=True)
class LearningRateChange:
    """Before step ``step`` the user multiplies the lr of one optimizer's param groups by ``factor``
    (through the outermost wrapper's ``param_groups``); ``group`` is "fused" or a dense group's name."""

    step: int
    group: str
    factor: float


@dataclass(frozen=True)
class HyperParameterChange:
    """Before step ``step`` the user calls ``update_hyper_parameters(dict(values))`` on the outermost
    wrapper: it reaches the optimizers that have the method (fbgemm's fused ones), not torch's."""

    step: int
    values: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class OptimizerWrapping:
    dense: tuple[DenseGroup, ...] = (DenseGroup("dense"),)
    clipping: Clipping | None = None
    warmup: Warmup | None = None
    lr_changes: tuple[LearningRateChange, ...] = ()
    hyper_parameter_changes: tuple[HyperParameterChange, ...] = ()
    # Before this step: state_dict() of the wrappers, then a fresh sharded model and fresh wrappers,
    # init_state(), the model's state and load_state_dict(): training continues from there.
    resume_at: int | None = None

    @property
    def group_names(self) -> tuple[str, ...]:
        return ("fused", *(g.name for g in self.dense))

    def __post_init__(self) -> None:
        names = [g.name for g in self.dense]
        if len(set(names)) != len(names) or "fused" in names:
            raise HarnessError(f"dense group names must be distinct and not 'fused', got {names}")
        unknown = [c.group for c in self.lr_changes if c.group not in self.group_names]
        if unknown:
            raise HarnessError(f"lr change for unknown optimizer(s) {unknown}; known: {self.group_names}")

    def describe(self) -> str:
        parts = ["dense=[" + ", ".join(g.describe() for g in self.dense) + "]"]
        parts += [self.clipping.describe()] if self.clipping else []
        parts += [self.warmup.describe()] if self.warmup else []
        parts += [f"lr x{c.factor:g} on {c.group} before step {c.step}" for c in self.lr_changes]
        parts += [f"update_hyper_parameters({dict(c.values)}) before step {c.step}" for c in self.hyper_parameter_changes]
        parts += [f"resume before step {self.resume_at}"] if self.resume_at is not None else []
        return " ".join(parts)


def group_parameters(groups: tuple[DenseGroup, ...], named: dict[str, torch.nn.Parameter]) -> list[dict[str, torch.nn.Parameter]]:
    """The parameters of each dense group (each parameter in the first group that takes it)."""
    taken: set[str] = set()
    out = []
    for group in groups:
        chosen = {name: p for name, p in named.items() if name not in taken and group.takes(name, p)}
        taken |= set(chosen)
        out.append(chosen)
    return out


def warmup_stages(warmup: Warmup) -> list[Any]:
    from torchrec.optim.warmup import WarmupPolicy, WarmupStage

    return [WarmupStage(policy=WarmupPolicy(s.policy), max_iters=s.max_iters, value=s.value, lr_scale=s.lr_scale,
                        decay_iters=s.decay_iters, sgdr_period=s.sgdr_period,
                        start_interpolating_iters=s.start_interpolating_iters, end_value=s.end_value) for s in warmup.stages]


def wrap_optimizers(wrapping: OptimizerWrapping, fused: Any, dense_named: dict[str, torch.nn.Parameter],
                    sharded_params: Callable[[], list[torch.Tensor]] = list) -> tuple[Any, Any]:
    """(outermost wrapper, the GradientClippingOptimizer or None) as a user builds them.

    ``fused`` is the model's fused optimizer (a KeyedOptimizer; None when there is none);
    ``sharded_params()`` the local shards of model-parallel tables that a dense optimizer trains."""
    from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.warmup import WarmupOptimizer

    optims: list[Any] = [("fused", fused)] if fused is not None else []
    for group, params in zip(wrapping.dense, group_parameters(wrapping.dense, dense_named)):
        if params:
            optims.append((group.name, KeyedOptimizerWrapper(params, _factory(group))))
    outer: Any = CombinedOptimizer(optims)
    clipper = None
    if wrapping.clipping is not None:
        spec = wrapping.clipping
        kwargs: dict[str, Any] = {}
        if spec.across_ranks:
            import torch.distributed as dist

            kwargs = {"enable_global_grad_clip": True, "param_to_pgs": {p: [dist.group.WORLD] for p in sharded_params()}}
        if "track_grad_norm" in inspect.signature(GradientClippingOptimizer.__init__).parameters:
            kwargs["track_grad_norm"] = True  # so that VALUE and NONE report their norm too (where torchrec can)
        mode = {"norm": GradientClipping.NORM, "value": GradientClipping.VALUE, "none": GradientClipping.NONE}[spec.mode]
        clipper = outer = GradientClippingOptimizer(outer, mode, max_gradient=spec.max_gradient, norm_type=spec.norm_type, **kwargs)
    if wrapping.warmup is not None:
        outer = WarmupOptimizer(outer, warmup_stages(wrapping.warmup), lr=wrapping.warmup.lr)
    return outer, clipper


def _factory(group: DenseGroup) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    cls, arguments = group.torch_class(), group.arguments()
    return lambda params: cls(params, **arguments)


def apply_lr_changes(wrapping: OptimizerWrapping, step: int, groups_of: Callable[[str], list[dict[str, Any]]]) -> None:
    """The user's lr changes due before ``step``, on the param groups ``groups_of(name)`` returns."""
    for change in wrapping.lr_changes:
        if change.step == step:
            for group in groups_of(change.group):
                group["lr"] = group["lr"] * change.factor
