"""Sharding an EC/EBC with a plan, moving full weights into its shards and back, and the dense step.

    sharded = shard_module(ec, plan, device="cpu", compute_kernel="fused", learning_rate=0.1)
    copy_full_weights_into(sharded, full)          # one full tensor per table -> local shards
    gather_full_weights(sharded)                   # every rank gets {table: full tensor}
    sgd_step_dense_parameters(sharded, lr)         # the step the fused kernel does in backward

All of it runs inside a rank with the default process group initialised. Fused kernels get an
EXACT_SGD optimizer applied inside backward; dense kernels (and data-parallel tables, which only
have a dense kernel) are stepped by ``sgd_step_dense_parameters``. Data-parallel gradients are
averaged over ranks (DDP), and so are model-parallel ones while torchrec's all-to-all gradient
division is on (its default, ``torchrec.distributed.comm_ops.get_gradient_division()``); a
reference must mirror that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from paritykit.errors import HarnessError
from paritykit.harness.plans import module_sharding_plan, sharder_for
from paritykit.harness.shards import gather_on_ranks, local_pieces, scatter
from paritykit.harness.tables import table_of_key


def gradient_division() -> bool:
    """Whether torchrec's all-to-all divides model-parallel gradients by the world size."""
    from torchrec.distributed import comm_ops

    if not hasattr(comm_ops, "get_gradient_division"):
        raise HarnessError("torchrec.distributed.comm_ops has no get_gradient_division: its gradient scaling is unknown")
    return bool(comm_ops.get_gradient_division())


def shard_module(
    module: nn.Module,
    plan: Mapping[str, Any],
    *,
    device: str = "cpu",
    compute_kernel: str = "fused",
    learning_rate: float = 0.1,
) -> nn.Module:
    """Shard an EC/EBC with an explicit per-table plan; fused kernels train with EXACT_SGD at ``learning_rate``."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.shard import shard
    from torchrec.distributed.types import ShardingEnv

    if not dist.is_initialized():
        raise HarnessError("shard_module must run inside a rank with the default process group initialised")
    sharder = sharder_for(module, {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": learning_rate})
    module_plan = module_sharding_plan(module, plan, device=device, compute_kernel=compute_kernel, world_size=dist.get_world_size())
    return shard(
        module, module_plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device(device), sharder=sharder
    )


def copy_full_weights_into(sharded: nn.Module, full_weights: Mapping[str, torch.Tensor]) -> None:
    """Copy each table's full tensor into this rank's local shards (every rank calls it)."""
    scatter(local_pieces(sharded.state_dict(), table_of_key), full_weights)


def gather_full_weights(sharded: nn.Module) -> dict[str, torch.Tensor]:
    """Every table put back together from the shards on all ranks; every rank gets the full tensors.

    Raises ParityError when the shards do not tile a table exactly once, or when the replicas of a
    data-parallel table differ between ranks.
    """
    return gather_on_ranks(local_pieces(sharded.state_dict(), table_of_key), "tables gathered from the shards")


def sgd_step_dense_parameters(sharded: nn.Module, learning_rate: float) -> int:
    """Plain SGD on every real parameter that got a gradient (dense kernels, data-parallel tables).

    Fused kernels have already stepped inside backward; their weights carry no gradient. Returns how
    many parameters were stepped.
    """
    # The sharded modules re-expose weights as TableBatchedEmbeddingSlice views of one TBE tensor per
    # group; a slice's .grad is a view of that tensor's .grad, and setting one slice's .grad to None
    # clears the gradient of every table in the group. So read every gradient first, step, then clear.
    params: list[tuple[nn.Parameter, torch.Tensor]] = []
    seen: set[int] = set()
    for submodule in sharded.modules():
        for param in submodule._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            if param.grad is not None:
                params.append((param, param.grad))
    with torch.no_grad():
        for param, grad in params:
            param.add_(grad, alpha=-learning_rate)
        for param, _ in params:
            param.grad = None
    return len(params)
