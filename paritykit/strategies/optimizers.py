"""Hypothesis strategies for optimizers as users configure them: an ``OptimizerSpec`` with drawn
hyper-parameters, for the fused embedding optimizer and for the dense one.

    from paritykit import strategies as pks

    @given(pks.embedding_optimizer_specs(), pks.dense_optimizer_specs())
    def test_my_model(embedding, dense):
        paritykit.assert_sharded_matches_unsharded(model_fn, plan, batches, pool=rank_pool,
                                                   embedding_optimizer=embedding, dense_optimizer=dense)

The ranges keep the comparison well-conditioned under paritykit's norm-wise bound (docs/sharding.md,
"Optimizers"): learning rates up to 0.5, weight decay up to 0.1 (so that 1 - lr * weight_decay stays
near 1), momenta and betas below 1; eps from 1e-8 to 0.1 for row-wise steps (they divide a gradient by
its row's size), and for element-wise adaptive steps (Adagrad, Adam) either below 1e-7 or at least
half the learning rate: an element whose gradient is a near-cancellation of size near eps turns the
roundoff of its gradient into a step of up to lr * roundoff / eps. Values are rounded to two
significant digits (log-uniform ones) or two decimals (uniform ones) so that a case id reads well
and replays exactly.
"""

from __future__ import annotations

from typing import Any, Iterable

from hypothesis import strategies as st

from paritykit.harness.optimizers import FUSED, OptimizerSpec, supported_fused_optimizers
from paritykit.harness.optimizers.catalog import COUNTER_WEIGHT_DECAY_MODES
from paritykit.harness.optimizers.fbgemm import applied_weight_decay_modes


def _log_uniform(low: float, high: float) -> st.SearchStrategy[float]:
    """10**x for x uniform in [log10 low, log10 high], two significant digits."""
    import math

    return st.floats(math.log10(low), math.log10(high)).map(lambda x: float(f"{10.0 ** x:.2g}"))


def _uniform(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high).map(lambda x: round(x, 2))


LEARNING_RATES = _log_uniform(1e-3, 0.5)
EPS = _log_uniform(1e-8, 0.1)


def elementwise_eps(lr: float) -> st.SearchStrategy[float]:
    """eps of an element-wise adaptive step at learning rate ``lr``: below 1e-7, or from lr / 2 to 1."""
    return st.one_of(_log_uniform(1e-8, 1e-7), _log_uniform(lr / 2, 1.0))
WEIGHT_DECAYS = st.one_of(st.just(0.0), _log_uniform(1e-4, 0.1))


@st.composite
def _rowwise_adagrad(draw: Any, modes: tuple[str, ...]) -> dict[str, Any]:
    mode = draw(st.sampled_from(modes))
    hypers: dict[str, Any] = {"eps": draw(EPS), "weight_decay_mode": mode}
    if mode != "none":
        hypers["weight_decay"] = draw(_log_uniform(1e-3, 0.1))
    if mode == "counter":
        hypers["counter_halflife"] = draw(st.integers(-1, 3))
        hypers["counter_weight_decay_mode"] = draw(st.sampled_from(COUNTER_WEIGHT_DECAY_MODES))
    return hypers


# name -> (learning rate -> its other hyper-parameters)
_FUSED_HYPERS = {
    "sgd": lambda lr: st.just({}),
    "adagrad": lambda lr: st.fixed_dictionaries({"eps": elementwise_eps(lr)}),
    "ema_rowwise_adagrad": lambda lr: st.fixed_dictionaries({
        "eps": EPS, "step_ema": st.integers(1, 3), "step_start": st.integers(0, 3), "step_ema_coef": _uniform(0.0, 1.0)}),
    "rowwise_rmsprop_ar": lambda lr: st.fixed_dictionaries({
        "eps": EPS, "ar_alpha": _uniform(0.0, 2.0), "ema_beta": _uniform(0.5, 0.99), "min_shrinkage": _uniform(0.0, 1.0)}),
}


def _specs(name: str, hypers: Any) -> st.SearchStrategy[OptimizerSpec]:
    return LEARNING_RATES.flatmap(lambda lr: hypers(lr).map(lambda drawn: OptimizerSpec(name, lr, **drawn)))


def embedding_optimizer_specs(names: Iterable[str] | None = None, device: str = "cpu",
                              weight_decay_modes: Iterable[str] | None = None) -> st.SearchStrategy[OptimizerSpec]:
    """Fused embedding optimizers the installed fbgemm trains on ``device`` (or those of ``names``),
    each with drawn hyper-parameters that fbgemm's kernel reads. Row-wise Adagrad's weight-decay
    modes default to "none" and those the kernel on ``device`` applies (fbgemm's CPU kernel ignores
    L2 and DECOUPLE: docs/sharding.md); ``weight_decay_modes`` names them instead."""
    supported = supported_fused_optimizers(device)
    modes = tuple(weight_decay_modes or ("none", *applied_weight_decay_modes(device)))
    hypers = {**_FUSED_HYPERS, "rowwise_adagrad": lambda lr: _rowwise_adagrad(modes)}
    chosen = [name for name in (names or FUSED) if name in supported]
    if not chosen:
        raise ValueError(f"none of {list(names or FUSED)} is a fused optimizer the installed fbgemm trains on {device} ({supported})")
    return st.sampled_from(chosen).flatmap(lambda name: _specs(name, hypers[name]))


@st.composite
def _sgd(draw: Any, lr: float) -> dict[str, Any]:
    momentum = draw(st.one_of(st.just(0.0), _uniform(0.1, 0.95)))
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov or momentum == 0 else draw(st.one_of(st.just(0.0), _uniform(0.0, 0.5)))
    return {"momentum": momentum, "dampening": dampening, "nesterov": nesterov, "weight_decay": draw(WEIGHT_DECAYS)}


def _adam(lr: float) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "betas": st.tuples(_uniform(0.0, 0.95), _log_uniform(1e-4, 0.1).map(lambda x: 1.0 - x)), "eps": elementwise_eps(lr),
        "weight_decay": WEIGHT_DECAYS, "amsgrad": st.booleans()})


_DENSE_HYPERS = {
    "sgd": _sgd,
    "adagrad": lambda lr: st.fixed_dictionaries({
        "eps": elementwise_eps(lr), "weight_decay": WEIGHT_DECAYS, "lr_decay": st.one_of(st.just(0.0), _uniform(0.0, 0.1)),
        "initial_accumulator_value": st.one_of(st.just(0.0), _uniform(0.0, 1.0))}),
    "rowwise_adagrad": lambda lr: st.fixed_dictionaries({"eps": EPS, "weight_decay": WEIGHT_DECAYS}),
    "adam": _adam,
    "adamw": _adam,
}


DENSE_DEFAULT = ("sgd", "adagrad", "adam", "adamw")


def dense_optimizer_specs(names: Iterable[str] | None = None) -> st.SearchStrategy[OptimizerSpec]:
    """torch optimizers for dense parameters (SGD with momentum/nesterov/weight decay, Adagrad, Adam,
    AdamW; torchrec's row-wise Adagrad by name, for models whose dense parameters are all 2-D),
    each with drawn keyword arguments."""
    chosen = list(names or DENSE_DEFAULT)
    unknown = [name for name in chosen if name not in _DENSE_HYPERS]
    if unknown:
        raise ValueError(f"{unknown} are not dense optimizers; known: {list(_DENSE_HYPERS)}")
    return st.sampled_from(chosen).flatmap(lambda name: _specs(name, _DENSE_HYPERS[name]))
