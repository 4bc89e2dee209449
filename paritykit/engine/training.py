"""One training run of a sharded model on every rank, recorded for comparison with the unsharded one.

``TrainingSetup`` is everything a run needs, resolved in the caller and sent to the ranks (so it must
pickle): the model factory, the full initial state, torchrec's resolved ShardingPlan, the batches
(``batches[step][rank]``), the optimizers and the loss. ``train_on_rank`` is the rank function;
``assemble`` turns the per-rank records into one ``TrainingRecord``, the same type the unsharded
reference produces (reference.py), so the two compare field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from paritykit.engine.dmp_options import DmpOptions
from paritykit.engine.losses import default_loss
from paritykit.engine.outputs import forward, to_cpu, to_device
from paritykit.engine.probes import EmbeddingProbe
from paritykit.errors import HarnessError
from paritykit.harness.devices import rank_device
from paritykit.harness.dmp import (
    fused_optimizer_pieces,
    load_full_state,
    state_pieces,
    submodules_by_name,
    table_parameters,
)
from paritykit.harness.optimizers import OptimizerSpec, apply_in_backward
from paritykit.harness.shards import assemble, detached, local_pieces


@dataclass
class TrainingSetup:
    model_fn: Callable[[], torch.nn.Module]
    full_state: dict[str, torch.Tensor]
    sharding_plan: Any
    batches: list[list[Any]]
    embedding_optimizer: OptimizerSpec
    dense_optimizer: OptimizerSpec
    loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss
    device: str = "cpu"
    # Module-level functions of the sharded model run on every rank after sharding; their results
    # come back in the record (the sharding check asks torchrec for its CW permutation this way).
    probes: tuple[Callable[[torch.nn.Module], Any], ...] = ()
    # How DMP and torchrec's collectives run it (sync collectives, gradient division, a hyper-parameter
    # schedule, quantized comms, meta init, copy, reshard): none may change the numbers.
    options: DmpOptions = field(default_factory=DmpOptions)
    # The hosts the plan was resolved for (a pool's ranks_per_host); None: one host.
    ranks_per_host: int | None = None

    @property
    def world_size(self) -> int:
        return len(self.batches[0]) if self.batches else 0

    @property
    def embedding_module_names(self) -> list[str]:
        return list(self.sharding_plan.plan)


@dataclass
class TrainingRecord:
    """outputs[step][rank], losses[step][rank] and embeddings[step][rank] (what each embedding module
    returned, by key; probes.py), then the full state after the last step. ``step_states[step]`` is the
    state after each step where the run records it (the plain loop and the unsharded reference do): it
    tells a wrong forward from a wrong update (comparison.first_divergence)."""

    outputs: list[list[Any]]
    losses: list[list[torch.Tensor]]
    embeddings: list[list[dict[str, Any]]]
    state: dict[str, torch.Tensor]
    probes: list[list[Any]] = field(default_factory=list)  # probes[rank][probe]
    fused_state: dict[str, torch.Tensor] = field(default_factory=dict)
    dense_state: dict[str, torch.Tensor] = field(default_factory=dict)
    step_states: list[dict[str, torch.Tensor]] = field(default_factory=list)


def build_model(setup: TrainingSetup) -> torch.nn.Module:
    """A fresh model with the full initial state and the fused embedding optimizer applied."""
    model = setup.model_fn()
    if not isinstance(model, torch.nn.Module):
        raise HarnessError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
    model.load_state_dict(setup.full_state)
    apply_in_backward(setup.embedding_optimizer, table_parameters(model))
    return model


def train_on_rank(setup: TrainingSetup) -> dict[str, Any]:
    """Runs on every rank: shard, load the same full state, train every step, record."""
    with setup.options.on_rank():
        return _train_on_rank(setup)


def _train_on_rank(setup: TrainingSetup) -> dict[str, Any]:
    import torch.distributed as dist
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    rank, device, options = dist.get_rank(), rank_device(setup.device), setup.options
    dmp = options.sharded(lambda: build_model(setup), setup.sharding_plan, device)
    load_full_state(dmp, {k: v.to(device) for k, v in setup.full_state.items()})
    dmp = options.trained(dmp, device)
    spec, params = setup.dense_optimizer, options.dense_parameters(dmp)
    # A model whose every parameter is a fused table has nothing for a dense optimizer to train.
    dense = KeyedOptimizerWrapper(params, lambda ps: spec.torch_class()(ps, **spec.arguments())) if params else None
    probed = [probe(dmp) for probe in setup.probes]
    probe = EmbeddingProbe(submodules_by_name(dmp, setup.embedding_module_names))
    outputs, losses, embeddings, step_states = [], [], [], []
    for step, step_batches in enumerate(setup.batches):
        options.before_step(dmp, step)
        batch = to_device(step_batches[rank], device)
        if dense is not None:
            dense.zero_grad()
        output = forward(dmp, batch)
        embeddings.append(probe.take())
        loss = setup.loss_fn(output, batch)
        loss.backward()
        if dense is not None:
            dense.step()
        options.after_step(dmp)
        outputs.append(to_cpu(output))
        losses.append(loss.detach().to("cpu").clone())
        step_states.append(state_pieces(dmp) + fused_optimizer_pieces(dmp))
    probe.remove()
    return {
        "outputs": outputs,
        "losses": losses,
        "embeddings": embeddings,
        "probes": probed,
        "state": state_pieces(dmp),
        "fused_state": fused_optimizer_pieces(dmp),
        "dense_state": detached(local_pieces(_replicated_optimizer_state(dmp, dense.state_dict()["state"] if dense else {}))),
        "step_states": step_states,
    }


def _replicated_optimizer_state(dmp: torch.nn.Module, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The dense optimizer's state of replicated parameters (dense layers, data-parallel tables).

    A dense-kernel table sharded over ranks keeps its optimizer state for its local shards only, in
    the layout of its batched kernel; its weights are compared instead (they carry that state's effect).
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    sharded = {key for key, value in dmp.state_dict().items() if isinstance(value, ShardedTensor)}
    flat = {}
    for param, entries in state.items():
        if param in sharded:
            continue
        for key, value in entries.items():
            if value is not None:
                flat[f"{param}/{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return flat


def assemble_records(per_rank: list[dict[str, Any]]) -> TrainingRecord:
    """One TrainingRecord from every rank's record; shards tile exactly once or ParityError."""
    steps = len(per_rank[0]["outputs"])
    return TrainingRecord(
        outputs=[[record["outputs"][s] for record in per_rank] for s in range(steps)],
        losses=[[record["losses"][s] for record in per_rank] for s in range(steps)],
        embeddings=[[record["embeddings"][s] for record in per_rank] for s in range(steps)],
        state=assemble([r["state"] for r in per_rank], "sharded model state after the last step"),
        fused_state=assemble([r["fused_state"] for r in per_rank], "fused optimizer state"),
        dense_state=assemble([r["dense_state"] for r in per_rank], "dense optimizer state"),
        probes=[record["probes"] for record in per_rank],
        step_states=[assemble([r["step_states"][s] for r in per_rank], f"sharded model state after step {s}")
                     for s in range(steps) if all("step_states" in r for r in per_rank)],
    )
