"""The oracle for ``WarmupOptimizer``: the learning rate of every step, computed by hand from what
each ``WarmupStage`` policy means (torchrec's docstrings and the papers they name), not from its code.

Step ``t`` (0-based) trains with ``lr * m(t)``. The stages run one after another: step ``t`` belongs
to the first stage whose ``max_iters`` is at least ``t`` (after the last stage the multiplier is 1).
Within a stage ``t`` is the global step, not the step within the stage:

    linear      value + (1 - value) * t / max_iters         from value up to 1 at max_iters
    constant    value
    poly        (1 - t / decay_iters) ** value              decay_iters defaults to max_iters
    step        value ** (t // decay_iters)                 decay_iters defaults to 1
    inv_sqrt    1 / sqrt(t)
    cosine_annealing_warm_restarts   value + (1 - value) * (1 + cos(pi * (t mod period) / period)) / 2
    interpolate value + (end_value - value) * (t - start) / (max_iters - start)
    none        1

and every multiplier is scaled by the stage's ``lr_scale``.
"""

from __future__ import annotations

import math

from paritykit.engine.optim_wrapping import Warmup, WarmupStageSpec


def stage_of(warmup: Warmup, step: int) -> WarmupStageSpec | None:
    """The stage step ``step`` belongs to; None once every stage is over."""
    for stage in warmup.stages:
        if step <= stage.max_iters:
            return stage
    return None


def multiplier(stage: WarmupStageSpec, t: int) -> float:
    decay = stage.decay_iters if stage.decay_iters > 0 else (1 if stage.policy == "step" else stage.max_iters)
    value = stage.value
    if stage.policy == "linear":
        m = value + (1.0 - value) * t / stage.max_iters
    elif stage.policy == "constant":
        m = value
    elif stage.policy == "poly":
        m = (1.0 - t / decay) ** value
    elif stage.policy == "step":
        m = value ** (t // decay)
    elif stage.policy == "inv_sqrt":
        m = 1.0 / math.sqrt(t)
    elif stage.policy == "cosine_annealing_warm_restarts":
        phase = (t % stage.sgdr_period) / stage.sgdr_period
        m = value + (1.0 - value) * (1.0 + math.cos(math.pi * phase)) / 2.0
    elif stage.policy == "interpolate":
        start = float(stage.start_interpolating_iters or 0)
        m = value + (float(stage.end_value or 0.0) - value) * (t - start) / (stage.max_iters - start)
    else:
        m = 1.0
    return m * stage.lr_scale


def scheduled_lr(warmup: Warmup, step: int) -> float:
    """The learning rate step ``step`` trains with."""
    stage = stage_of(warmup, step)
    return warmup.lr * (1.0 if stage is None else multiplier(stage, step))
