"""The rank side of an optimizer-wrapper run: the sharded model trained through torchrec's wrappers
as a user stacks them (optim_wrapping.py), optionally interrupted and resumed from state dicts.

Each step is what a user writes: the lr changes due (through the outermost wrapper's
``param_groups``), ``zero_grad()`` (which also hands the fused optimizer's lr to fbgemm), forward,
backward, ``step()``. Recorded besides training.py's record: the lr of every optimizer at every
step as torchrec's param groups hold it, the total gradient norm torchrec's clipping computed, and
the dense optimizers' keyed state of replicated parameters (``state_dict()`` of the wrappers).

Resuming before step k: ``state_dict()`` of the wrappers (``save_param_groups(True)``) and of the
model, then a freshly sharded model and fresh wrappers, ``init_state()``, the model's
``load_state_dict`` and the wrappers' ``load_state_dict`` (torchrec's documented in-place loading),
then ``set_optimizer_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paritykit.engine.optim_wrapping import OptimizerWrapping, wrap_optimizers
from paritykit.engine.outputs import forward, to_cpu, to_device
from paritykit.engine.probes import EmbeddingProbe
from paritykit.engine.reference import table_placements
from paritykit.engine.training import TrainingSetup, build_model
from paritykit.harness.devices import rank_device
from paritykit.harness.dmp import dense_parameters, load_full_state, shard_model, state_pieces, submodules_by_name
from paritykit.harness.shards import detached, local_pieces


@dataclass
class Wrapped:
    dmp: torch.nn.Module
    outer: Any
    clipper: Any
    combined: Any  # the CombinedOptimizer inside the wrappers

    def groups_of(self, name: str) -> list[dict[str, Any]]:
        """The param groups of optimizer ``name``, as the outermost wrapper hands them out."""
        start = 0
        for key, optimizer in self.combined.optimizers:
            count = len(optimizer.param_groups)
            if key == name:
                return list(self.outer.param_groups)[start : start + count]
            start += count
        return []

    def lrs(self) -> dict[str, float]:
        return {name: groups[0]["lr"] for name, _ in self.combined.optimizers if (groups := self.groups_of(name))}


def model_parallel_dense_tables(setup: TrainingSetup) -> set[str]:
    """FQNs of tables that a dense optimizer trains in local shards (dense kernel, not data-parallel)."""
    model = setup.model_fn()
    return {p.fqn for p in table_placements(model, setup.sharding_plan).values() if not p.fused and not p.replicated}


def _sharded(setup: TrainingSetup, device: torch.device) -> torch.nn.Module:
    dmp = shard_model(build_model(setup), setup.sharding_plan, device)
    load_full_state(dmp, {k: v.to(device) for k, v in setup.full_state.items()})
    return dmp


def _wrap(dmp: torch.nn.Module, wrapping: OptimizerWrapping, sharded: set[str]) -> Wrapped:
    named = dense_parameters(dmp)
    outer, clipper = wrap_optimizers(wrapping, dmp.fused_optimizer, named, lambda: [named[n] for n in sorted(sharded) if n in named])
    combined = outer
    while not hasattr(combined, "optimizers"):
        combined = combined._optimizer
    if wrapping.resume_at is not None:
        outer.save_param_groups(True)
    return Wrapped(dmp, outer, clipper, combined)


def _resumed(setup: TrainingSetup, wrapping: OptimizerWrapping, old: Wrapped, sharded: set[str], device: torch.device,
             step: int) -> Wrapped:
    saved_optimizer, saved_model = old.outer.state_dict(), old.dmp.state_dict()
    fresh = _wrap(_sharded(setup, device), wrapping, sharded)
    fresh.outer.init_state()
    fresh.dmp.load_state_dict(saved_model)
    fresh.outer.load_state_dict(saved_optimizer)
    # As a resuming user does: the fused optimizers continue their step count (it moves nothing
    # that SGD or Adagrad compute; optimizers with bias correction need it).
    fresh.outer.set_optimizer_step(step)
    return fresh


def train_wrapped_on_rank(setup: TrainingSetup, wrapping: OptimizerWrapping) -> dict[str, Any]:
    import torch.distributed as dist

    rank, device = dist.get_rank(), rank_device(setup.device)
    sharded = model_parallel_dense_tables(setup)
    run = _wrap(_sharded(setup, device), wrapping, sharded)
    outputs, losses, embeddings, norms, lrs = [], [], [], [], []
    probe = None
    for step, step_batches in enumerate(setup.batches):
        if step == wrapping.resume_at:
            run = _resumed(setup, wrapping, run, sharded, device, step)
            probe.remove()
            probe = None
        probe = probe or EmbeddingProbe(submodules_by_name(run.dmp, setup.embedding_module_names))
        for change in wrapping.lr_changes:
            if change.step == step:
                for group in run.groups_of(change.group):
                    group["lr"] = group["lr"] * change.factor
        for change in wrapping.hyper_parameter_changes:
            if change.step == step:
                run.outer.update_hyper_parameters(dict(change.values))
        lrs.append(run.lrs())
        batch = to_device(step_batches[rank], device)
        run.outer.zero_grad()
        output = forward(run.dmp, batch)
        embeddings.append(probe.take())
        loss = setup.loss_fn(output, batch)
        loss.backward()
        run.outer.step()
        norm = getattr(run.clipper, "last_total_grad_norm", None) if run.clipper is not None else None
        norms.append(None if norm is None else float(norm))
        outputs.append(to_cpu(output))
        losses.append(loss.detach().to("cpu").clone())
    probe.remove()
    return {"outputs": outputs, "losses": losses, "embeddings": embeddings, "state": state_pieces(run.dmp),
            "dense_state": detached(local_pieces(keyed_dense_state(run, wrapping, sharded))), "norms": norms, "lrs": lrs}


def keyed_dense_state(run: Wrapped, wrapping: OptimizerWrapping, sharded: set[str]) -> dict[str, torch.Tensor]:
    """The wrappers' ``state_dict()`` of the dense optimizers, replicated parameters only."""
    groups = {g.name for g in wrapping.dense}
    flat = {}
    for key, entries in run.outer.state_dict()["state"].items():
        optimizer, _, fqn = key.partition(".")
        if optimizer not in groups or fqn in sharded:
            continue
        for name, value in entries.items():
            if value is not None:
                flat[f"{key}/{name}"] = torch.as_tensor(value).detach().clone().float()
    return flat
