"""The oracle: the unsharded model trained on every rank's batch, with torchrec's semantics mirrored.

torchrec trains a sharded model so that, per step, each parameter sees (1/W) * sum over ranks of the
gradient of that rank's loss: DDP averages dense parameters and data-parallel tables; model-parallel
tables are averaged by the backward all-to-all while ``get_gradient_division()`` is on (its default),
summed when it is off. Fused tables are stepped by the embedding optimizer (fused TBE), dense-kernel
and data-parallel tables and dense layers by the dense optimizer. The reference does exactly that in
one process: it sums the ranks' losses, scales each gradient by its share, and steps. Dense
parameters step with the torch optimizer itself; fused tables with the reference of fbgemm's rule
(harness/optimizers: torch's SGD and Adagrad, paritykit's row-wise family), which keeps one state row
per row of each column shard, steps only the rows the step looked up (``TouchedRows``) and counts
fbgemm's iterations, as the TBE does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paritykit.engine.outputs import forward, to_cpu
from paritykit.engine.probes import EmbeddingProbe
from paritykit.engine.training import TrainingRecord, TrainingSetup
from paritykit.engine.touched_rows import TouchedRows
from paritykit.harness.optimizers import oracle
from paritykit.harness.plan_resolution import embedding_modules, sharder_of

DENSE_KERNELS = ("dense",)


@dataclass(frozen=True)
class TablePlacement:
    """How torchrec trains one table: its FQN in the model, fused or not, replicated or not, column blocks."""

    fqn: str
    table: str
    fused: bool
    replicated: bool
    column_blocks: tuple[int, ...]
    shards: int = 1


def table_placements(model: nn.Module, sharding_plan: Any) -> dict[int, TablePlacement]:
    """id(parameter) -> TablePlacement, for every table of every sharded module of ``model``."""
    names = {id(param): fqn for fqn, param in model.named_parameters()}
    placements = {}
    for module_fqn, module in embedding_modules(model).items():
        for table, param in sharder_of(module).shardable_parameters(module).items():
            sharding = sharding_plan.plan[module_fqn][table]
            replicated = sharding.sharding_type == "data_parallel"
            placements[id(param)] = TablePlacement(
                fqn=names[id(param)],
                table=table,
                fused=not replicated and sharding.compute_kernel not in DENSE_KERNELS,
                replicated=replicated,
                column_blocks=_column_blocks(sharding, param.shape[1]),
                shards=len(sharding.sharding_spec.shards) if sharding.sharding_spec is not None else 1,
            )
    return placements


def _column_blocks(sharding: Any, width: int) -> tuple[int, ...]:
    if sharding.sharding_spec is None:
        return (width,)
    offsets = sorted({int(shard.shard_offsets[1]) for shard in sharding.sharding_spec.shards}) + [width]
    return tuple(b - a for a, b in zip(offsets, offsets[1:]))


def _optimizers(setup: TrainingSetup, model: nn.Module, placements: dict[int, TablePlacement]):
    fused = [p for p in model.parameters() if id(p) in placements and placements[id(p)].fused]
    dense = [p for p in model.parameters() if not (id(p) in placements and placements[id(p)].fused)]
    blocks = {id(p): list(placements[id(p)].column_blocks) for p in fused}
    embedding = oracle.reference_optimizer(setup.embedding_optimizer, fused, blocks) if fused else None
    dense_optimizer = setup.dense_optimizer.torch_class()(dense, **setup.dense_optimizer.arguments()) if dense else None
    return embedding, dense_optimizer, fused


def gradient_scales(model: nn.Module, placements: dict[int, TablePlacement], world_size: int, division: bool):
    """id(parameter) -> the factor torchrec applies to the sum of the ranks' gradients."""
    model_parallel = 1.0 / world_size if division else 1.0
    return {
        id(p): model_parallel if (id(p) in placements and not placements[id(p)].replicated) else 1.0 / world_size
        for p in model.parameters()
    }


def train_reference(setup: TrainingSetup, division: bool = True) -> TrainingRecord:
    """The unsharded model from the same full state, trained on every step's batches of every rank."""
    model = setup.model_fn()
    model.load_state_dict(setup.full_state)
    placements = table_placements(model, setup.sharding_plan)
    embedding, dense, fused_tables = _optimizers(setup, model, placements)
    if setup.options.gradient_division is not None:
        division = setup.options.gradient_division
    scales = gradient_scales(model, placements, setup.world_size, division)
    modules = {name: model.get_submodule(name) for name in setup.embedding_module_names}
    probe, touched = EmbeddingProbe(modules), TouchedRows(modules)
    outputs, losses, embeddings, step_states = [], [], [], []
    for step, step_batches in enumerate(setup.batches):
        setup.options.reference_step(embedding, step)
        model.zero_grad(set_to_none=True)
        oracle.begin_step(embedding)
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
        oracle.touch(embedding, touched.take())
        for optimizer in (embedding, dense):
            if optimizer is not None:
                optimizer.step()
        outputs.append([to_cpu(output) for output in step_outputs])
        losses.append([loss.detach().clone() for loss in step_losses])
        embeddings.append(step_embeddings)
        step_states.append({**{key: value.detach().clone() for key, value in model.state_dict().items()},
                            **_fused_state(embedding, fused_tables, placements)})
    probe.remove()
    touched.remove()
    return TrainingRecord(
        outputs=outputs,
        losses=losses,
        embeddings=embeddings,
        state={key: value.detach().clone() for key, value in model.state_dict().items()},
        fused_state=_fused_state(embedding, fused_tables, placements),
        dense_state=_dense_state(model, dense, placements),
        step_states=step_states,
    )


def _dense_state(model: nn.Module, optimizer: Any, placements: dict[int, TablePlacement]) -> dict[str, torch.Tensor]:
    if optimizer is None:
        return {}
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    flat = {}
    for param, entries in optimizer.state.items():
        placement = placements.get(id(param))
        if placement is not None and not placement.replicated:
            continue  # sharded dense-kernel tables: see training._replicated_optimizer_state
        for key, value in entries.items():
            if value is not None:
                flat[f"{names[id(param)]}/{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return flat


def _fused_state(optimizer: Any, tables: list[nn.Parameter], placements: dict[int, TablePlacement]) -> dict[str, torch.Tensor]:
    """The embedding optimizer's state in torchrec's fused layout: ``<fqn>/<table>.momentum1``, ...."""
    if optimizer is None:
        return {}
    flat = {}
    for param in tables:
        placement = placements[id(param)]
        for name, value in oracle.fused_state(optimizer, param, placement.shards).items():
            flat[f"{placement.fqn}/{placement.table}.{name}"] = value
    return flat
