"""Checkpointing a sharded model and its optimizers on the ranks, the way torchrec users do, and resuming.

A user saves one of two ways (``CheckpointRecipe.method``):
- ``"dcp"``: ``torch.distributed.checkpoint.save({"model": dmp.state_dict(), <optimizers>: ...})``;
  to resume, a fresh DMP (any plan, any world size) hands its own state dicts to ``dcp.load``, which
  fills them in place by global offsets (resharding), then ``dmp.load_state_dict`` and every
  optimizer's ``load_state_dict`` (which calls ``post_load_state_dict``);
- ``"per_rank"``: ``torch.save`` of every rank's state dicts, ``torch.load`` on the same rank.

The optimizers are those of ``training.train_on_rank``: the DMP's ``fused_optimizer`` (torchrec's
CombinedOptimizer of the tables' fused TBE optimizers) and a ``KeyedOptimizerWrapper`` of the dense
optimizer over every other parameter; saved as two entries, or as one ``CombinedOptimizer`` of both
(``combined``, as torchrec's examples build it), optionally under torchrec's ``WarmupOptimizer``.
The dense optimizer's state is lazy, so it is created with torchrec's ``init_state()`` before a load
(a KeyedOptimizer refuses to load into an optimizer without state).

``run_phase`` trains one phase on a rank: optionally restore first, train the steps, save after
``save_after`` of them and carry on. What a step records is ``training.train_on_rank``'s; a snapshot
(``snapshot``) is the model's and every optimizer's state as this rank holds it, for the caller to
gather from the shards and compare.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from paritykit.engine.outputs import forward, to_cpu, to_device
from paritykit.engine.probes import EmbeddingProbe
from paritykit.engine.training import TrainingSetup, _replicated_optimizer_state, build_model
from paritykit.errors import HarnessError, ParityError, frame_owner
from paritykit.harness.devices import rank_device
from paritykit.harness.dmp import (
    dense_parameters,
    fused_optimizer_pieces,
    load_full_state,
    shard_model,
    state_pieces,
    submodules_by_name,
)
from paritykit.harness.shards import detached, local_pieces

METHODS = ("dcp", "per_rank")
WARMUP_POLICIES = ("linear", "constant", "poly", "step", "inv_sqrt")


@dataclass(frozen=True)
class CheckpointRecipe:
    """How the run checkpoints. ``warmup``: torchrec WarmupStage values as (policy, max_iters, value)
    around the dense optimizer (or the combined one); empty: no warm-up. ``param_groups``: the
    optimizers save their param groups too (torchrec's ``save_param_groups(True)``)."""

    method: str = "dcp"
    combined: bool = False
    warmup: tuple[tuple[str, int, float], ...] = ()
    param_groups: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise HarnessError(f"checkpoint method must be one of {METHODS}, got {self.method!r}")
        bad = [stage for stage in self.warmup if len(stage) != 3 or stage[0] not in WARMUP_POLICIES or stage[1] < 1]
        if bad:
            raise HarnessError(f"warm-up stages are (policy in {WARMUP_POLICIES}, max_iters >= 1, value); got {bad}")

    def describe(self) -> str:
        parts = [self.method] + (["combined"] if self.combined else []) + ([f"warmup{list(self.warmup)}"] if self.warmup else [])
        parts += ["param_groups"] if self.param_groups else []
        return "+".join(parts)


@dataclass
class PhaseRun:
    """One phase on every rank: ``setup`` (plan, this phase's batches, optimizers), the checkpoint
    directory, and whether to restore before the first step and/or save after ``save_after`` steps."""

    setup: TrainingSetup
    directory: str
    recipe: CheckpointRecipe
    save_after: int | None = None
    restore: bool = False


class Optimizers:
    """The rank's optimizers as the recipe builds them; ``saved`` names what goes into a checkpoint."""

    def __init__(self, dmp: torch.nn.Module, setup: TrainingSetup, recipe: CheckpointRecipe) -> None:
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

        spec, params = setup.dense_optimizer, dense_parameters(dmp)
        self.fused = getattr(dmp, "fused_optimizer", None)
        # A model whose every parameter is a fused table has nothing for a dense optimizer to train.
        self.dense = KeyedOptimizerWrapper(params, lambda ps: spec.torch_class()(ps, **spec.arguments())) if params else None
        both = self.fused is not None and self.dense is not None
        self.combined = CombinedOptimizer([self.fused, self.dense]) if recipe.combined and both else None
        stepped = self.combined or self.dense
        self.outer = _with_warmup(stepped, recipe.warmup, spec.lr) if stepped is not None and recipe.warmup else stepped
        for optimizer in self.saved().values() if recipe.param_groups else ():
            optimizer.save_param_groups(True)

    def saved(self) -> dict[str, Any]:
        """Checkpoint entry -> the optimizer whose state_dict it holds."""
        if self.combined is not None:
            return {"optim": self.outer}
        return {name: opt for name, opt in (("fused", self.fused), ("dense", self.outer)) if opt is not None}

    def zero_grad(self) -> None:
        if self.outer is not None:
            self.outer.zero_grad()

    def step(self) -> None:
        if self.outer is not None:
            self.outer.step()

    def init_state(self) -> None:
        """torchrec's own way to create lazy optimizer state before loading into it."""
        if self.outer is not None:
            self.outer.init_state()

    def learning_rates(self) -> dict[str, float]:
        """``fused/<param>`` and ``dense/<param>`` -> the learning rate its next step uses."""
        rates = {}
        for name, opt in (("fused", self.fused), ("dense", self.dense)):
            if opt is None:
                continue
            keys = {id(param): key for key, param in opt.params.items()}
            for group in opt.param_groups:
                rates.update({f"{name}/{keys[id(param)]}": float(group["lr"]) for param in group["params"] if id(param) in keys})
        return rates


def _with_warmup(optimizer: Any, stages: tuple[tuple[str, int, float], ...], lr: float) -> Any:
    from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

    built = [WarmupStage(policy=WarmupPolicy(policy), max_iters=int(iters), value=float(value)) for policy, iters, value in stages]
    return WarmupOptimizer(optimizer, built, lr=lr)


def snapshot(dmp: torch.nn.Module, optimizers: Optimizers) -> dict[str, Any]:
    """This rank's part of the model's and the optimizers' state, and the learning rates.

    ``local_state`` is the dense optimizer's state of tables sharded over ranks with the dense kernel:
    plain tensors of this rank's shards (no global offsets), comparable only rank by rank.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    dense_state = optimizers.dense.state_dict()["state"] if optimizers.dense is not None else {}
    sharded = {key for key, value in dmp.state_dict().items() if isinstance(value, ShardedTensor)}
    local = {f"{param}/{key}": value for param, entries in dense_state.items() if param in sharded
             for key, value in entries.items() if isinstance(value, torch.Tensor)}
    return {
        "state": state_pieces(dmp),
        "fused_state": fused_optimizer_pieces(dmp),
        "dense_state": detached(local_pieces(_replicated_optimizer_state(dmp, dense_state))),
        "local_state": {key: value.detach().cpu().clone() for key, value in local.items()},
        "learning_rates": optimizers.learning_rates(),
    }


def _entries(dmp: torch.nn.Module, optimizers: Optimizers) -> dict[str, Any]:
    return {"model": dmp.state_dict(), **{name: opt.state_dict() for name, opt in optimizers.saved().items()}}


def save(dmp: torch.nn.Module, optimizers: Optimizers, directory: str, method: str) -> None:
    """What a user's training job does at a checkpoint."""
    import torch.distributed as dist

    with _torchrec_failure("saving the checkpoint"):
        if method == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save(_entries(dmp, optimizers), storage_writer=dcp.FileSystemWriter(directory))
        else:
            torch.save(_entries(dmp, optimizers), os.path.join(directory, f"rank{dist.get_rank()}.pt"))


def restore(dmp: torch.nn.Module, optimizers: Optimizers, directory: str, method: str) -> None:
    """What a user's job does to resume: lazy optimizer state created, the checkpoint read into this
    model's own state dicts, then every ``load_state_dict``."""
    import torch.distributed as dist

    with _torchrec_failure("loading the checkpoint"):
        optimizers.init_state()
        if method == "dcp":
            import torch.distributed.checkpoint as dcp

            entries = _entries(dmp, optimizers)
            dcp.load(entries, storage_reader=dcp.FileSystemReader(directory))
        else:
            entries = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"), weights_only=False)
        dmp.load_state_dict(entries["model"])
        for name, opt in optimizers.saved().items():
            opt.load_state_dict(entries[name])


class _torchrec_failure:
    """An exception that torch.distributed.checkpoint (platform code) raises while this module hands it
    torchrec's state dicts is torchrec's failure to round-trip, as a user would meet it: a ParityError.
    paritykit's generic rule would blame the innermost paritykit frame, which is the user's call here.
    Anything raised inside torchrec (or a plant) or elsewhere in paritykit keeps its own meaning."""

    def __init__(self, doing: str) -> None:
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, _tb: Any) -> bool:
        # torch.distributed.checkpoint's CheckpointException is a BaseException: only interrupts pass.
        if exc is None or isinstance(exc, (KeyboardInterrupt, SystemExit, ParityError, HarnessError)):
            return False
        if _innermost_owner(exc) != __name__:
            return False
        raise ParityError(f"{self.doing} failed inside torch.distributed.checkpoint/torchrec: "
                          f"{type(exc).__name__}: {_first_lines(str(exc))}") from exc


def _innermost_owner(exc: BaseException) -> str:
    """The module of the innermost frame that is not platform code (torch, the standard library)."""
    modules = [str(frame.f_globals.get("__name__") or "") for frame, _line in traceback.walk_tb(exc.__traceback__)]
    owned = [name for name in modules if frame_owner(name) != "platform"]
    return owned[-1] if owned else ""


def _first_lines(text: str, lines: int = 6) -> str:
    # torch.distributed.checkpoint repeats every rank's traceback; the reason is on its first lines.
    kept = [line for line in text.splitlines() if line.strip() and not line.startswith(" ")]
    return "\n".join(kept[:lines])


def run_phase(run: PhaseRun) -> dict[str, Any]:
    """Runs on every rank: shard, take the same initial state, optionally restore, train every step
    (saving after ``save_after`` of them), record; snapshots at the save and after the restore."""
    import torch.distributed as dist

    setup, rank, device = run.setup, dist.get_rank(), rank_device(run.setup.device)
    dmp = shard_model(build_model(setup), setup.sharding_plan, device)
    load_full_state(dmp, {k: v.to(device) for k, v in setup.full_state.items()})
    optimizers = Optimizers(dmp, setup, run.recipe)
    record: dict[str, Any] = {"outputs": [], "losses": [], "embeddings": []}
    if run.restore:
        on_every_rank("loading the checkpoint", lambda: restore(dmp, optimizers, run.directory, run.recipe.method))
        record["restored"] = snapshot(dmp, optimizers)
    probe = EmbeddingProbe(submodules_by_name(dmp, setup.embedding_module_names))
    for index, step_batches in enumerate(setup.batches):
        if run.save_after == index:
            _save_here(dmp, optimizers, run, record)
        batch = to_device(step_batches[rank], device)
        optimizers.zero_grad()
        output = forward(dmp, batch)
        record["embeddings"].append(probe.take())
        loss = setup.loss_fn(output, batch)
        loss.backward()
        optimizers.step()
        record["outputs"].append(to_cpu(output))
        record["losses"].append(loss.detach().to("cpu").clone())
    probe.remove()
    if run.save_after == len(setup.batches):
        _save_here(dmp, optimizers, run, record)
    record["final"] = snapshot(dmp, optimizers)
    return record


def _save_here(dmp: torch.nn.Module, optimizers: Optimizers, run: PhaseRun, record: dict[str, Any]) -> None:
    record["saved"] = snapshot(dmp, optimizers)
    on_every_rank("saving the checkpoint", lambda: save(dmp, optimizers, run.directory, run.recipe.method))


def on_every_rank(doing: str, action: Callable[[], None]) -> None:
    """``action`` on this rank, then every rank learns whether any failed and raises if one did: a
    load that fails on one rank only (torchrec's own load_state_dict raising there) must not leave the
    others waiting in the next step's collectives (the pool would have to rebuild its ranks)."""
    import torch.distributed as dist

    error: BaseException | None = None
    try:
        action()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
        error = exc
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if error is None else f"{type(error).__name__}: {_first_lines(str(error))}")
    if error is not None:
        raise error
    failed = [(rank, text) for rank, text in enumerate(failures) if text]
    if failed:
        rank, text = failed[0]
        raise ParityError(f"{doing} failed on rank {rank}: {text}")
