"""The oracle for torchrec's optimizer wrappers: the unsharded model trained with torch's own
optimizers, torch's own clipping and a hand-computed learning rate per step.

On top of the sharded-vs-unsharded semantics of reference.py (every rank's loss, each parameter's
gradient scaled as torchrec scales it), per step:
- the learning rate: each optimizer's own, times the user's changes; under a warm-up, the rate of
  ``optim_schedule.scheduled_lr`` for every optimizer (fused and dense alike);
- clipping over exactly the parameters whose gradients exist in the sharded model: dense layers,
  data-parallel and dense-kernel tables. A fused table's gradient never materializes (fbgemm's TBE
  applies it inside the backward), so torchrec's clipping cannot see it and its update is unclipped;
  the oracle clips the others with ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` and
  reports the total norm;
- torchrec's ``RowWiseAdagrad`` on a dense parameter: ``HandRowWiseAdagrad``, its update rule
  written out (one accumulator per row, per column shard of a column-wise dense-kernel table).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paritykit.engine.optim_schedule import scheduled_lr
from paritykit.engine.optim_wrapping import OptimizerWrapping, group_parameters
from paritykit.engine.outputs import forward, to_cpu
from paritykit.engine.probes import EmbeddingProbe
from paritykit.engine.reference import gradient_scales, table_placements
from paritykit.engine.training import TrainingRecord, TrainingSetup
from paritykit.harness.optimizers import BlockRowWiseAdagrad


class HandRowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad written out: per row (of each column block) the accumulator gains the mean
    squared gradient; the row moves by lr / (1 + (step - 1) * lr_decay) * g / (sqrt(sum) + eps), with
    g the gradient (negated to maximize) plus weight_decay * param."""

    def __init__(self, params: list[nn.Parameter], blocks: dict[int, tuple[int, ...]], lr: float = 1e-2,
                 lr_decay: float = 0.0, weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, maximize: bool = False) -> None:
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize))
        self._blocks = blocks
        for group in self.param_groups:
            for p in group["params"]:
                widths = blocks.get(id(p), (p.shape[1],))
                self.state[p]["step"] = torch.tensor(0.0)
                self.state[p]["sum"] = torch.full((p.shape[0], len(widths)), float(initial_accumulator_value), dtype=p.dtype)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                grad = -p.grad if group["maximize"] else p.grad
                if group["weight_decay"]:
                    grad = grad + group["weight_decay"] * p
                rate = group["lr"] / (1 + (state["step"].item() - 1) * group["lr_decay"])
                start = 0
                for block, width in enumerate(self._blocks.get(id(p), (p.shape[1],))):
                    g = grad[:, start : start + width]
                    state["sum"][:, block] += g.pow(2).mean(dim=1)
                    std = state["sum"][:, block : block + 1].sqrt() + group["eps"]
                    p[:, start : start + width] -= rate * g / std
                    start += width


def _fused_optimizer(setup: TrainingSetup, params: list[nn.Parameter], placements: dict) -> Any:
    spec = setup.embedding_optimizer
    if not params:
        return None
    if spec.name == "rowwise_adagrad":
        return BlockRowWiseAdagrad(params, {id(p): list(placements[id(p)].column_blocks) for p in params}, **spec.arguments())
    return spec.torch_class()(params, **spec.arguments())


def _dense_optimizers(wrapping: OptimizerWrapping, named: dict[str, nn.Parameter], placements: dict) -> dict[str, Any]:
    optimizers = {}
    for group, params in zip(wrapping.dense, group_parameters(wrapping.dense, named)):
        if not params:
            continue
        if group.optimizer == "rowwise_adagrad":
            blocks = {id(p): placements[id(p)].column_blocks for p in params.values() if id(p) in placements}
            optimizers[group.name] = HandRowWiseAdagrad(list(params.values()), blocks, **group.arguments())
        else:
            optimizers[group.name] = group.torch_class()(list(params.values()), **group.arguments())
    return optimizers


def _clip(wrapping: OptimizerWrapping, params: list[nn.Parameter]) -> float | None:
    spec = wrapping.clipping
    with_grad = [p for p in params if p.grad is not None]
    if spec is None or not with_grad:
        return None
    if spec.mode == "norm":
        return float(torch.nn.utils.clip_grad_norm_(with_grad, spec.max_gradient, norm_type=spec.norm_type))
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=spec.norm_type))
    if spec.mode == "value":
        torch.nn.utils.clip_grad_value_(with_grad, spec.max_gradient)
    return norm


def _set_lrs(optimizers: dict[str, Any], lr: float) -> None:
    for optimizer in optimizers.values():
        for group in optimizer.param_groups:
            group["lr"] = lr


def _lr_changes(wrapping: OptimizerWrapping, optimizers: dict[str, Any], step: int) -> None:
    for change in wrapping.lr_changes:
        if change.step == step and change.group in optimizers:
            for group in optimizers[change.group].param_groups:
                group["lr"] *= change.factor
    # update_hyper_parameters reaches the fused optimizer only (torch's have no such method).
    for hyper in wrapping.hyper_parameter_changes:
        if hyper.step == step and "fused" in optimizers:
            for group in optimizers["fused"].param_groups:
                group.update(dict(hyper.values))


def train_wrapped_reference(setup: TrainingSetup, wrapping: OptimizerWrapping, division: bool = True) -> tuple[TrainingRecord, dict[str, Any]]:
    """(the record, {"norms": [per step], "lrs": [per step {optimizer: lr}]}) of the unsharded model."""
    model = setup.model_fn()
    model.load_state_dict(setup.full_state)
    placements = table_placements(model, setup.sharding_plan)
    fused_params = [p for p in model.parameters() if id(p) in placements and placements[id(p)].fused]
    dense_named = {n: p for n, p in model.named_parameters() if not (id(p) in placements and placements[id(p)].fused)}
    optimizers = {"fused": _fused_optimizer(setup, fused_params, placements), **_dense_optimizers(wrapping, dense_named, placements)}
    optimizers = {name: opt for name, opt in optimizers.items() if opt is not None}
    if wrapping.warmup is not None:
        _set_lrs(optimizers, scheduled_lr(wrapping.warmup, 0))
    scales = gradient_scales(model, placements, setup.world_size, division)
    # Clipping sees the parameters its optimizers train (a dense layer no group takes is left out).
    clipped = [p for params in group_parameters(wrapping.dense, dense_named) for p in params.values()]
    probe = EmbeddingProbe({name: model.get_submodule(name) for name in setup.embedding_module_names})
    outputs, losses, embeddings, norms, lrs = [], [], [], [], []
    for step, step_batches in enumerate(setup.batches):
        _lr_changes(wrapping, optimizers, step)
        lrs.append({name: opt.param_groups[0]["lr"] for name, opt in optimizers.items()})
        model.zero_grad(set_to_none=True)
        step_outputs, step_embeddings = [], []
        for batch in step_batches:
            step_outputs.append(forward(model, batch))
            step_embeddings.append(probe.take())
        step_losses = [setup.loss_fn(output, batch) for output, batch in zip(step_outputs, step_batches)]
        torch.stack(step_losses).sum().backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.mul_(scales[id(param)])
        norms.append(_clip(wrapping, clipped))
        for optimizer in optimizers.values():
            optimizer.step()
        if wrapping.warmup is not None:
            _set_lrs(optimizers, scheduled_lr(wrapping.warmup, step + 1))
        outputs.append([to_cpu(output) for output in step_outputs])
        losses.append([loss.detach().clone() for loss in step_losses])
        embeddings.append(step_embeddings)
    probe.remove()
    record = TrainingRecord(outputs=outputs, losses=losses, embeddings=embeddings,
                            state={k: v.detach().clone() for k, v in model.state_dict().items()},
                            dense_state=_keyed_dense_state(optimizers, dense_named, placements))
    return record, {"norms": norms, "lrs": lrs}


def _keyed_dense_state(optimizers: dict[str, Any], named: dict[str, nn.Parameter], placements: dict) -> dict[str, torch.Tensor]:
    """The dense optimizers' state of replicated parameters, keyed as CombinedOptimizer keys it:
    ``<optimizer>.<parameter fqn>/<state name>`` (model-parallel tables' state lives in shards)."""
    fqn = {id(p): n for n, p in named.items()}
    flat = {}
    for name, optimizer in optimizers.items():
        if name == "fused":
            continue
        for param, entries in optimizer.state.items():
            placement = placements.get(id(param))
            if placement is not None and not placement.replicated:
                continue
            for key, value in entries.items():
                if value is not None:
                    flat[f"{name}.{fqn[id(param)]}/{key}"] = torch.as_tensor(value).detach().clone().float()
    return flat
