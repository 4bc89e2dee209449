"""Every optimizer paritykit can configure, by name, with the hyper-parameters each one honours.

Two kinds:

- **fused** (embedding tables): torchrec hands the class and keyword arguments given to
  ``apply_optimizer_in_backward`` to fbgemm's table-batched embedding (TBE) kernel, which steps the
  table inside the backward. Only what the kernel reads is listed: a hyper-parameter fbgemm ignores
  (momentum for exact SGD, weight decay for exact Adagrad) is refused, since no comparison could see it.
  The list is fbgemm's CPU kernels (``EmbOptimType`` members whose TBE trains on CPU): exact SGD,
  exact Adagrad, exact row-wise Adagrad (weight decay L2, decoupled or counter-based), EMA in-place
  row-wise Adagrad, and row-wise RMSprop with adaptive regularization where fbgemm has it (fbgemm.py
  tells which the installed stack supports).
- **dense** (everything else): a torch optimizer, with torch's own keyword arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

WEIGHT_DECAY_MODES = ("none", "l2", "decouple", "counter")
COUNTER_WEIGHT_DECAY_MODES = ("none", "l2", "decouple")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _non_negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _fraction(value: Any) -> bool:
    return _non_negative(value) and value <= 1


def _whole(minimum: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass(frozen=True)
class Hyper:
    """One hyper-parameter of a fused optimizer: its default and what a valid value is."""

    name: str
    default: Any
    valid: Callable[[Any], bool]
    expects: str


EPS = Hyper("eps", 1e-8, _positive, "a positive float")
WEIGHT_DECAY = Hyper("weight_decay", 0.0, _non_negative, "a float >= 0")
WEIGHT_DECAY_MODE = Hyper("weight_decay_mode", "none", WEIGHT_DECAY_MODES.__contains__, f"one of {WEIGHT_DECAY_MODES}")
COUNTER_HALFLIFE = Hyper("counter_halflife", -1, _whole(-1), "an int >= -1 (-1 counts every touch, 0 none, k a half-life in steps)")
COUNTER_WEIGHT_DECAY_MODE = Hyper("counter_weight_decay_mode", "none", COUNTER_WEIGHT_DECAY_MODES.__contains__,
                                  f"one of {COUNTER_WEIGHT_DECAY_MODES}")


@dataclass(frozen=True)
class FusedOptimizer:
    """A fused optimizer: fbgemm's ``EmbOptimType`` member, the class a user gives
    ``apply_optimizer_in_backward``, the hyper-parameters fbgemm's kernel reads, and whether torchrec
    learns the type from an explicit ``optimizer`` keyword (it has no class of its own)."""

    name: str
    emb_opt_type: str
    torchrec_class: str
    hypers: tuple[Hyper, ...]
    explicit_type: bool = False

    def hyper(self, name: str) -> Hyper | None:
        return next((h for h in self.hypers if h.name == name), None)


FUSED = {
    "sgd": FusedOptimizer("sgd", "EXACT_SGD", "torch.optim.SGD", ()),
    "adagrad": FusedOptimizer("adagrad", "EXACT_ADAGRAD", "torch.optim.Adagrad", (EPS,)),
    "rowwise_adagrad": FusedOptimizer(
        "rowwise_adagrad", "EXACT_ROWWISE_ADAGRAD", "torchrec.optim.RowWiseAdagrad",
        (EPS, WEIGHT_DECAY, WEIGHT_DECAY_MODE, COUNTER_HALFLIFE, COUNTER_WEIGHT_DECAY_MODE),
    ),
    "ema_rowwise_adagrad": FusedOptimizer(
        "ema_rowwise_adagrad", "EMAINPLACE_ROWWISE_ADAGRAD", "torchrec.optim.RowWiseAdagrad",
        (EPS, Hyper("step_ema", 10, _whole(1), "an int >= 1"), Hyper("step_start", 0, _whole(0), "an int >= 0"),
         Hyper("step_ema_coef", 0.6, _fraction, "a float in [0, 1]")),
        explicit_type=True,
    ),
    "rowwise_rmsprop_ar": FusedOptimizer(
        "rowwise_rmsprop_ar", "ROWWISE_RMSPROP_AR", "torchrec.optim.RowWiseAdagrad",
        (EPS, Hyper("ar_alpha", 0.0, _non_negative, "a float >= 0"), Hyper("ema_beta", 0.99, _fraction, "a float in [0, 1]"),
         Hyper("min_shrinkage", 0.1, _fraction, "a float in [0, 1]")),
        explicit_type=True,
    ),
}

# Dense optimizers: a torch class and the defaults paritykit passes (both sides get the same).
DENSE = {
    "sgd": ("torch.optim.SGD", {}),
    "adagrad": ("torch.optim.Adagrad", {"eps": 1e-8}),
    "rowwise_adagrad": ("torchrec.optim.RowWiseAdagrad", {"eps": 1e-8}),
    "adam": ("torch.optim.Adam", {}),
    "adamw": ("torch.optim.AdamW", {}),
}

KNOWN = tuple(dict.fromkeys([*FUSED, *DENSE]))


def import_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


def fused_problems(optimizer: FusedOptimizer, hypers: dict[str, Any]) -> list[str]:
    """What is wrong with ``hypers`` for ``optimizer`` (empty: nothing), each naming the key."""
    problems = []
    for key, value in hypers.items():
        hyper = optimizer.hyper(key)
        if hyper is None:
            honoured = ", ".join(["lr", *(h.name for h in optimizer.hypers)])
            problems.append(f"{key!r}: fbgemm's fused {optimizer.name} kernel does not read it (it reads {honoured}); "
                            "torchrec would pass it on and the table would train without it")
        elif not hyper.valid(value):
            problems.append(f"{key!r} must be {hyper.expects}, got {value!r}")
    if problems or optimizer.name != "rowwise_adagrad":
        return problems
    mode = hypers.get("weight_decay_mode", "none")
    if hypers.get("weight_decay", 0.0) and mode == "none":
        problems.append("'weight_decay' without a 'weight_decay_mode' ('l2', 'decouple' or 'counter'): fbgemm applies no "
                        "weight decay in mode NONE")
    if mode != "counter" and any(key.startswith("counter_") for key in hypers):
        problems.append("'counter_halflife' and 'counter_weight_decay_mode' need weight_decay_mode='counter'")
    return problems
