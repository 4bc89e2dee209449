"""On a rank: the DMP-sharded model and the dense optimizer a pipeline trains, from a TrainingSetup.

Built exactly as the sharding engine's plain loop (``paritykit.engine.training.train_on_rank``)
builds them: the model factory with the fused embedding optimizer applied, sharded by the resolved
plan, the full initial state copied into the shards, and a KeyedOptimizerWrapper over every
parameter no fused optimizer trains. So the plain loop, every pipeline and the unsharded reference
start from bit-identical state.
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.engine.training import TrainingSetup, build_model
from paritykit.errors import HarnessError
from paritykit.harness.dmp import dense_parameters, load_full_state, shard_model


def sharded_for_training(setup: TrainingSetup, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """(DMP model, dense optimizer) on this rank; run inside a rank of an initialised process group."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    dmp = shard_model(build_model(setup), setup.sharding_plan, device)
    load_full_state(dmp, {key: value.to(device) for key, value in setup.full_state.items()})
    params = dense_parameters(dmp)
    if not params:
        raise HarnessError(
            "torchrec's train pipelines step a dense optimizer, and this model has no parameter outside its "
            "fused embedding tables"
        )
    spec = setup.dense_optimizer
    return dmp, KeyedOptimizerWrapper(params, lambda ps: spec.torch_class()(ps, **spec.arguments()))
