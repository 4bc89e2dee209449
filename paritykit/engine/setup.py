"""Everything a sharded-vs-unsharded training run needs, resolved and validated in the caller."""

from __future__ import annotations

import pickle
from typing import Any, Callable

import torch

from paritykit.engine.inputs import check_batches
from paritykit.engine.losses import default_loss
from paritykit.engine.training import TrainingSetup
from paritykit.errors import HarnessError
from paritykit.harness.dmp import table_parameters
from paritykit.harness.optimizers import OptimizerSpec, apply_in_backward, require_dense_optimizer, require_embedding_optimizer
from paritykit.harness.plan_resolution import resolve_plan

DEFAULT_LR = 0.1


def build_setup(
    model_fn: Callable[[], torch.nn.Module],
    plan: Any,
    batches: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    embedding_optimizer: OptimizerSpec | str | None = None,
    dense_optimizer: OptimizerSpec | str | None = None,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    device: str = "cpu",
    ranks_per_host: int | None = None,
) -> TrainingSetup:
    """Everything a run needs, resolved and validated in the caller (HarnessError for a user's mistake).

    ``ranks_per_host``: the hosts of the ranks that will train it (a pool's ``ranks_per_host``); the
    plan is resolved for them, not for this process's environment."""
    _check_picklable("model_fn", model_fn)
    if loss_fn is not None:
        _check_picklable("loss_fn", loss_fn)
    steps = [list(step) for step in batches]
    world_size = check_batches(steps)
    torch.manual_seed(seed)
    model = model_fn()
    if not isinstance(model, torch.nn.Module):
        raise HarnessError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
    full_state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    embedding = require_embedding_optimizer(OptimizerSpec.of(embedding_optimizer, lr), device)
    # torchrec picks the fused kernel for tables that carry an in-backward optimizer: mark them first.
    apply_in_backward(embedding, table_parameters(model))
    sharding_plan = resolve_plan(model, plan, world_size=world_size, device_type=torch.device(device).type,
                                 local_size=ranks_per_host)
    check_batches(steps, model=model)
    return TrainingSetup(
        model_fn=model_fn,
        full_state=full_state,
        sharding_plan=sharding_plan,
        batches=steps,
        embedding_optimizer=embedding,
        dense_optimizer=require_dense_optimizer(OptimizerSpec.of(dense_optimizer, lr)),
        loss_fn=loss_fn or default_loss,
        device=device,
        ranks_per_host=ranks_per_host,
    )


def _check_picklable(name: str, value: Any) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - any reason it cannot travel to the ranks
        raise HarnessError(f"{name} must be picklable to reach the ranks (define it at module level): {exc}") from exc


