"""A checkpoint round trip, resolved and validated in the caller before any rank runs.

``before`` is the run that saves: ``plan`` on ``len(batches[0])`` ranks, trained on every batch,
saving after ``save_after`` steps and carrying on (the uninterrupted run). ``after`` is the resumed
run: ``reload_plan`` (default ``plan``) on ``len(reload_batches[0])`` ranks (default: the first run's
own batches after the save), built from *other* initial weights than the saved ones, so that a table
the load misses cannot pass for a loaded one, then restored from the checkpoint and trained.

A reload may move every table anywhere among the placements torchrec offers and change the world
size, but not how a table trains: a table sharded with the fused kernel, sharded with the dense
kernel, or data-parallel keeps that kind (its optimizer state lives in the fused optimizer, in the
dense optimizer, or in the dense optimizer as a replicated tensor; moving it between them is another
optimizer, not a reshard). Breaking that is a HarnessError naming the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from paritykit.engine.checkpoint import CheckpointRecipe
from paritykit.engine.reference import table_placements
from paritykit.engine.setup import DEFAULT_LR, build_setup
from paritykit.engine.training import TrainingSetup
from paritykit.errors import HarnessError
from paritykit.harness.optimizers import OptimizerSpec
from paritykit.harness.plans import placements_of
from paritykit.harness.seeding import generator


@dataclass
class CheckpointSetup:
    before: TrainingSetup
    after: TrainingSetup
    save_after: int
    recipe: CheckpointRecipe
    # The resumed run trains the first run's own batches after the save: the two compare step by step.
    carried_on: bool
    # The hosts both runs' ranks stand for (None: one host), as their plans were resolved for.
    ranks_per_host: int | None = None

    @property
    def same_plan(self) -> bool:
        return self.before.world_size == self.after.world_size and plan_signature(self.before) == plan_signature(self.after)

    def describe(self) -> str:
        where = "the same plan" if self.same_plan else f"another plan on {self.after.world_size} rank(s)"
        return (f"saved after step {self.save_after - 1} of {len(self.before.batches)} on {self.before.world_size} rank(s), "
                f"reloaded into {where} for {len(self.after.batches)} step(s) ({self.recipe.describe()}; "
                f"{self.before.embedding_optimizer.describe()} fused, {self.before.dense_optimizer.describe()} dense)")


def build_checkpoint_setup(
    model_fn: Callable[[], torch.nn.Module],
    plan: Any,
    batches: Any,
    *,
    save_after: int,
    reload_plan: Any = None,
    reload_batches: Any = None,
    recipe: CheckpointRecipe | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    embedding_optimizer: OptimizerSpec | str | None = None,
    dense_optimizer: OptimizerSpec | str | None = None,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    device: str = "cpu",
    ranks_per_host: int | None = None,
) -> CheckpointSetup:
    """Both runs resolved (plans against the model, batches checked), or a HarnessError naming the fault.
    ``ranks_per_host``: the hosts both runs' ranks stand for (None: one host); the plans are resolved for them."""
    steps = [list(step) for step in batches]
    if isinstance(save_after, bool) or not isinstance(save_after, int) or not 1 <= save_after <= len(steps):
        raise HarnessError(f"save_after must be a step count in [1, {len(steps)}] (len(batches)), got {save_after!r}")
    carried_on = reload_batches is None
    continuation = steps[save_after:] if carried_on else [list(step) for step in reload_batches]
    if not continuation:
        raise HarnessError(f"nothing to train after the reload: batches has {len(steps)} step(s) and save_after is "
                           f"{save_after}; give more batches or reload_batches")
    common = dict(loss_fn=loss_fn, embedding_optimizer=embedding_optimizer, dense_optimizer=dense_optimizer, lr=lr,
                  seed=seed, device=device, ranks_per_host=ranks_per_host)
    before = build_setup(model_fn, plan, steps, **common)
    after = build_setup(model_fn, plan if reload_plan is None else reload_plan, continuation, **common)
    after = dataclasses.replace(after, full_state=fresh_state(after.full_state))
    recipe = recipe or CheckpointRecipe()
    if recipe.method == "per_rank" and before.world_size != after.world_size:
        raise HarnessError(f"a per-rank checkpoint (torch.save on every rank) reloads on the same world size only: "
                           f"saved on {before.world_size} ranks, reload_batches are for {after.world_size}")
    check_same_kinds(before, after)
    return CheckpointSetup(before, after, save_after, recipe, carried_on, ranks_per_host)


def fresh_state(full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Other floating values of the same shapes (deterministic per key): the resumed model's start."""
    return {key: torch.randn(value.shape, generator=generator("checkpoint-fresh-start", key), dtype=value.dtype)
            if value.is_floating_point() else value.clone() for key, value in full_state.items()}


def _kind(placement: Any) -> str:
    if placement.replicated:
        return "data-parallel (the dense optimizer, replicated)"
    return "sharded with the fused kernel (the fused optimizer)" if placement.fused else "sharded with the dense kernel (the dense optimizer)"


def check_same_kinds(before: TrainingSetup, after: TrainingSetup) -> None:
    """Every table trains the same way before and after the reload (module docstring)."""
    saved = {p.fqn: p for p in table_placements(before.model_fn(), before.sharding_plan).values()}
    for placement in table_placements(after.model_fn(), after.sharding_plan).values():
        was = saved.get(placement.fqn)
        if was is not None and _kind(was) != _kind(placement):
            raise HarnessError(f"table {placement.table!r} ({placement.fqn}): the saved plan has it {_kind(was)}, the reload "
                               f"plan {_kind(placement)}; its optimizer state cannot carry over (keep each table's kind)")


def plan_signature(setup: TrainingSetup) -> tuple:
    """What a plan places where: per module and table, the sharding type, kernel, and every shard's
    offsets, sizes and rank (equal signatures hold equal local shards on every rank)."""
    return tuple((module, table, *entry) for (module, table), entry in sorted(placements_of(setup.sharding_plan).items()))
