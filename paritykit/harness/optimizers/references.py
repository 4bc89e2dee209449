"""Independent references of fbgemm's fused optimizers, for the unsharded model.

Where torch has the same rule, torch is the reference: fused exact SGD (lr) is ``torch.optim.SGD``,
exact Adagrad (lr, eps) ``torch.optim.Adagrad``. The row-wise family has no torch equivalent, so
each is written here from fbgemm's documented update (its optimizer code generator), in the
notation used there, with what a sharded table adds:

- **one state row per row of each column block**: torchrec cuts a column-wise table into shards
  that fbgemm treats as tables of their own, so a row-wise accumulator averages the squared gradient
  over the shard's columns only. ``blocks[id(param)]`` lists the block widths (one block: the
  unsharded table).
- **sparse updates**: fbgemm steps only the rows the batch looked up (``touch``), so weight decay,
  counters and moving averages leave the other rows alone; a dense torch optimizer would decay them.
- **fbgemm's iteration counter**: the TBE counts its forwards (``begin_step``), from 1.

``fused_state(param)`` gives each state as torchrec's fused optimizer exposes it: ``momentum1`` (the
accumulator), then fbgemm's own names (``prev_iter``, ``row_counter``, ``iter``); a per-row state of a
column-cut table lists the blocks one after another.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class FusedRowWiseReference(torch.optim.Optimizer):
    """Steps touched rows block by block with ``update_rows``; subclasses give the rule and its states."""

    def __init__(self, params: list[torch.nn.Parameter], blocks: dict[int, list[int]], lr: float, eps: float = 1e-8,
                 **hypers: Any) -> None:
        super().__init__(list(params), {"lr": lr, "eps": eps, **hypers})
        self._blocks = blocks
        self._touched: dict[int, torch.Tensor] | None = None
        self.iteration = 0

    def row_states(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum1",)

    def begin_step(self) -> None:
        """A forward of fbgemm's TBE: its iteration counter moves first."""
        self.iteration += 1

    def touch(self, rows: dict[int, torch.Tensor] | None) -> None:
        """The rows each parameter's lookups read this step (None: every row, the dense view)."""
        self._touched = rows

    def widths(self, param: torch.Tensor) -> list[int]:
        return self._blocks.get(id(param), [param.shape[1]])

    def _state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, torch.Tensor]:
        state = self.state[param]
        for name in self.row_states(group):
            if name not in state:
                state[name] = torch.zeros(param.shape[0], len(self.widths(param)), dtype=param.dtype, device=param.device)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                state = self._state(param, group)
                rows = torch.arange(param.shape[0]) if self._touched is None else self._touched.get(id(param))
                if rows is None or rows.numel() == 0 or param.grad is None:
                    continue
                grad, start = param.grad[rows], 0
                for block, width in enumerate(self.widths(param)):
                    cols = slice(start, start + width)
                    row_state = {name: state[name][rows, block] for name in self.row_states(group)}
                    param[rows, cols] = self.update_rows(group, param[rows, cols], grad[:, cols], row_state)
                    for name, value in row_state.items():
                        state[name][rows, block] = value
                    start += width

    def update_rows(self, group: dict[str, Any], w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def fused_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        state = self._state(param, group)
        return {name: state[name].t().reshape(-1).clone() for name in self.row_states(group)}


def _mean_square(g: torch.Tensor) -> torch.Tensor:
    return (g * g).mean(dim=1)


class BlockRowWiseAdagrad(FusedRowWiseReference):
    """fbgemm's exact row-wise Adagrad, per column block, with its weight-decay modes:

    - none:      s += mean(g^2);  m = lr / (sqrt(s) + eps);  w = w - m g
    - l2:        s += mean((g + wd w)^2);  w = (1 - m wd) w - m g
    - decouple:  s += mean(g^2);  w = (1 - lr wd) w - m g
    - counter (counter-based regularization, learning-rate mode EQUAL): a per-row counter
      c (half-life h > 0: c = 1 + 2^(-(steps since last touch) / h) c; h = 0: c = 1; h = -1: c += 1),
      freq = h / c, then the counter weight-decay mode: l2 as above with (1 - freq wd m),
      decouple with (1 - freq wd lr); prev_iter records the step.

    Without weight decay it is ``torchrec.optim.RowWiseAdagrad`` on each block.
    """

    def __init__(self, params: list[torch.nn.Parameter], blocks: dict[int, list[int]], lr: float, eps: float = 1e-8,
                 weight_decay: float = 0.0, weight_decay_mode: str = "none", counter_halflife: int = -1,
                 counter_weight_decay_mode: str = "none", **unused: Any) -> None:
        super().__init__(params, blocks, lr, eps, weight_decay=weight_decay, weight_decay_mode=weight_decay_mode,
                         counter_halflife=counter_halflife, counter_weight_decay_mode=counter_weight_decay_mode)

    def row_states(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum1", "prev_iter", "row_counter") if group["weight_decay_mode"] == "counter" else ("momentum1",)

    def update_rows(self, group: dict[str, Any], w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        lr, eps, wd, mode = group["lr"], group["eps"], group["weight_decay"], group["weight_decay_mode"]
        freq = torch.ones_like(state["momentum1"])
        if mode == "counter":
            freq, mode = self._count(group, state), group["counter_weight_decay_mode"]
        effective = g + wd * w if mode == "l2" else g
        state["momentum1"] = state["momentum1"] + _mean_square(effective)
        multiplier = lr / (state["momentum1"].sqrt() + eps)
        if mode == "l2":
            correction = 1.0 - freq * wd * multiplier
        elif mode == "decouple":
            correction = 1.0 - freq * wd * lr
        else:
            correction = torch.ones_like(multiplier)
        return correction[:, None] * w - multiplier[:, None] * g

    def _count(self, group: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.Tensor:
        """The row counter's update and freq = half-life / counter; prev_iter records this step."""
        halflife, previous, counter = group["counter_halflife"], state["prev_iter"], state["row_counter"]
        if halflife > 0:
            delta = torch.where(previous == 0, torch.ones_like(previous), self.iteration - previous)
            counter = 1.0 + torch.exp(-delta * (math.log(2.0) / halflife)) * counter
        elif halflife == 0:
            counter = torch.ones_like(counter)
        else:
            counter = counter + 1.0
        state["row_counter"], state["prev_iter"] = counter, torch.full_like(previous, float(self.iteration))
        return halflife / counter


class EmaRowWiseAdagrad(BlockRowWiseAdagrad):
    """fbgemm's EMA in-place row-wise Adagrad: row-wise Adagrad, and at every forward whose iteration
    i has i % step_ema == 0 and i >= step_start, before the lookup, the second half of each table's
    columns moves toward the first: slow = slow + coef (fast - slow), on every row. A column-cut
    table's shards are tables to fbgemm, so each block is halved on its own."""

    def __init__(self, params: list[torch.nn.Parameter], blocks: dict[int, list[int]], lr: float, eps: float = 1e-8,
                 step_ema: int = 10, step_start: int = 0, step_ema_coef: float = 0.6, **unused: Any) -> None:
        super().__init__(params, blocks, lr, eps)
        self._ema = (int(step_ema), int(step_start), float(step_ema_coef))

    @torch.no_grad()
    def begin_step(self) -> None:
        super().begin_step()
        step_ema, step_start, coef = self._ema
        if self.iteration % step_ema or self.iteration < step_start:
            return
        for group in self.param_groups:
            for param in group["params"]:
                start = 0
                for width in self.widths(param):
                    half = width // 2
                    param[:, start + half : start + width].lerp_(param[:, start : start + half], coef)
                    start += width


class RowWiseRMSpropAR(FusedRowWiseReference):
    """fbgemm's row-wise RMSprop with adaptive regularization (lazy, staleness-aware weight decay):

        v = beta v + (1 - beta) mean(g^2);  m = lr / (sqrt(v) + eps)
        gap = 1 on a row's first touch, else (step - prev_iter);  lambda = clamp(lr ar_alpha gap, 0, 1)
        w = max(min_shrinkage, 1 - lambda) w - m g;  prev_iter = step
    """

    def __init__(self, params: list[torch.nn.Parameter], blocks: dict[int, list[int]], lr: float, eps: float = 1e-8,
                 ar_alpha: float = 0.0, ema_beta: float = 0.99, min_shrinkage: float = 0.1, **unused: Any) -> None:
        super().__init__(params, blocks, lr, eps, ar_alpha=ar_alpha, ema_beta=ema_beta, min_shrinkage=min_shrinkage)

    def row_states(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum1", "prev_iter")

    def update_rows(self, group: dict[str, Any], w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        lr, eps, beta = group["lr"], group["eps"], group["ema_beta"]
        state["momentum1"] = beta * state["momentum1"] + (1.0 - beta) * _mean_square(g)
        multiplier = lr / (state["momentum1"].sqrt() + eps)
        previous = state["prev_iter"]
        gap = torch.where(previous == 0, torch.ones_like(previous), self.iteration - previous)
        shrink = (lr * group["ar_alpha"] * gap).clamp(0.0, 1.0)
        correction = (1.0 - shrink).clamp_min(group["min_shrinkage"])
        state["prev_iter"] = torch.full_like(previous, float(self.iteration))
        return correction[:, None] * w - multiplier[:, None] * g

    def fused_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**super().fused_state(param), "iter": torch.tensor([self.iteration], dtype=torch.int64)}
